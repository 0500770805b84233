#!/usr/bin/env python3
"""Writes tests/data/eval/heldout-english.txt: plain modern English prose generated from
templates with a fixed seed, for kvserve-eval's teacher-forced metrics (--text) and as retrieval
filler (--filler).

Why generated: the eval needs English text that no model here was trained on (the demo model
learnt the KJV; SmolLM2 saw the web), that may be redistributed, and that is small. A generator
gives all three; its sentences are simple but grammatical and varied (short stories about
people, places, errands, weather, work and conversations), so perplexity and the KL / top-1
agreement of a KV strategy are measured on ordinary English rather than on verse lines.

  python3 scripts/make-heldout-english.py [--out tests/data/eval/heldout-english.txt]
      [--paragraphs 400] [--seed 2026]

The output depends only on the seed and this file (Python's random.Random is stable across
versions for the calls used here: random(), randint(), choice(), sample(), shuffle()).
"""
import argparse
import os
import random

NAMES = ["Maria", "Tom", "Priya", "Daniel", "Aisha", "Lucas", "Emma", "Kenji", "Sofia", "Omar",
         "Hannah", "Pedro", "Grace", "Mateo", "Chloe", "Ivan", "Nora", "Samuel", "Leila", "Victor",
         "Ruth", "Felix", "Amara", "Oliver", "Mei", "Jonas", "Clara", "Ravi", "Elena", "Marcus"]
PLACES = ["the market", "the library", "the train station", "the old bakery", "the harbor",
          "the town hall", "the bus stop", "the community garden", "the hardware store",
          "the post office", "the riverside park", "the museum", "the school gym",
          "the corner cafe", "the hospital", "the bookshop", "the bicycle shop", "the farm"]
TOWNS = ["a small town near the coast", "a busy city in the north", "a quiet village in the hills",
         "a farming town by the river", "an old port city", "a suburb outside the capital"]
ITEMS = ["apples", "a loaf of bread", "two notebooks", "a new umbrella", "some light bulbs",
         "a bag of rice", "fresh flowers", "a spare key", "a pair of boots", "a birthday card",
         "a box of nails", "tomato seeds", "a map of the region", "a warm scarf", "batteries",
         "a jar of honey", "paint for the fence", "a cooking pot", "stamps", "a bicycle pump"]
JOBS = ["a nurse", "a carpenter", "a teacher", "a bus driver", "an engineer", "a baker",
        "a librarian", "a farmer", "a nurse on the night shift", "a student", "a mechanic",
        "a photographer", "a cook", "an accountant", "a gardener", "a journalist"]
WEATHER = ["It was raining lightly", "The sun was bright", "A cold wind came from the sea",
           "The sky was grey and heavy", "It was the warmest day of the year so far",
           "Fog covered the streets", "Snow had fallen during the night", "The air smelled of rain"]
TIMES = ["On Monday morning", "Late in the afternoon", "Early on Saturday", "After lunch",
         "Just before sunset", "On a Tuesday in March", "The next day", "That evening",
         "In the middle of the week", "One autumn morning", "Before work", "On the first of June"]
FEELINGS = ["tired", "happy", "worried", "curious", "relieved", "hungry", "excited", "calm",
            "nervous", "cheerful", "annoyed", "surprised"]
REASONS = ["because the shop closed early", "because the bus was late",
           "because a friend needed help", "because the road was being repaired",
           "because it had started to rain", "because the list was longer than expected",
           "because the phone battery was almost empty", "because the price had gone up"]
TOPICS = ["the weather", "the new bridge", "a film they had seen", "their plans for the summer",
          "a book about birds", "the football match", "the price of vegetables",
          "a recipe for soup", "an old photograph", "the town's festival", "a broken window",
          "the noise from the building site"]
ADJ = ["small", "old", "crowded", "quiet", "bright", "narrow", "friendly", "cold", "busy", "tidy"]
VERBS_PAST = ["walked", "drove", "cycled", "took the bus", "hurried", "went slowly"]


def sentence_pool(r, a, b):
    """Candidate sentences about two people a and b; returns a list of strings."""
    place, place2 = r.sample(PLACES, 2)
    item, item2 = r.sample(ITEMS, 2)
    n = r.randint(2, 12)
    return [
        "%s, %s %s to %s to buy %s." % (r.choice(TIMES), a, r.choice(VERBS_PAST), place, item),
        "%s. %s felt %s and decided to stay inside for a while." % (r.choice(WEATHER), a, r.choice(FEELINGS)),
        "%s works as %s and usually starts at %d o'clock." % (b, r.choice(JOBS), r.randint(5, 10)),
        "The %s street outside %s was full of people." % (r.choice(ADJ), place),
        "%s met %s near %s, and they talked about %s." % (a, b, place2, r.choice(TOPICS)),
        "\"Do you know where I can find %s?\" asked %s." % (item2, a),
        "\"Try %s,\" said %s. \"They had some last week.\"" % (place2, b),
        "It took %s about %d minutes to get home %s." % (a, r.randint(5, 50), r.choice(REASONS)),
        "%s wrote %d things on a list and crossed out %d of them by noon." % (b, n, r.randint(1, n)),
        "There were %d people waiting at %s, so %s waited outside." % (r.randint(3, 30), place, b),
        "%s had lived in %s for %d years." % (a, r.choice(TOWNS), r.randint(2, 40)),
        "When %s came back, the kettle was already on and %s was reading." % (a, b),
        "%s paid %d euros for %s and thought it was a fair price." % (b, r.randint(2, 90), item),
        "The %s room at %s was warmer than %s had expected." % (r.choice(ADJ), place2, a),
        "%s promised to call %s again before the end of the week." % (b, a),
        "Nobody at %s had heard of %s, which surprised %s." % (place, item2, a),
        "%s was %s, but the walk along the river helped." % (b, r.choice(FEELINGS)),
        "In the end %s forgot %s and had to go back the next morning." % (a, item2),
    ]


def paragraph(r):
    a, b = r.sample(NAMES, 2)
    pool = sentence_pool(r, a, b)
    k = r.randint(3, 7)
    idx = sorted(r.sample(range(len(pool)), k))
    return " ".join(pool[i] for i in idx)


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "data", "eval", "heldout-english.txt"))
    ap.add_argument("--paragraphs", type=int, default=400)
    ap.add_argument("--seed", type=int, default=2026)
    args = ap.parse_args()
    r = random.Random(args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for _ in range(args.paragraphs):
            f.write(paragraph(r) + "\n")
    print("wrote %s" % args.out)


if __name__ == "__main__":
    main()
