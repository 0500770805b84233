"""Training documents for the kvserve demo model (shared by prepare-demo-data.py and
train-demo-model.py).

Sources: the King James Version of the Bible (public domain; Debian package bible-kjv-text,
extracted with the `bible` program of package bible-kjv) plus generated documents:
  - "text": runs of consecutive verses, either "Book C:V text" lines or bare verse text lines;
  - "retrieval": facts stated somewhere in a long filler context (256..4096 tokens), asked
    about at the end (several formats, see FACT_KINDS and RETRIEVAL_STYLES);
  - "chat": ChatML conversations (recite a verse, what does a book say about a word, where is
    a quotation written, greetings, and questions about a passage given in the system turn).

Every document is a list of token ids built from pieces that each end in "\n" (or at a
special token) and start with a non-space character: with the Qwen2 split regex used by the
tokenizer such boundaries are pre-token boundaries, so the concatenated ids equal what the
tokenizer gives for the whole text (prepare-demo-data.py checks this on samples).
Each token also gets a loss weight: 1 for ordinary text, ANSWER_W for answers, and CRIT_W
for the first answer token that only the key->value lookup can predict (the first digit of a
code, the first word of a value): that one token is the whole retrieval skill, so it carries the
most weight. Within one packed row no subject is used twice: documents are not masked from each
other, and a name stated with two values in one row would make the lookup ambiguous.

Curriculum: Gen.progress (0..1, set by the trainer from the wall clock) grows the longest
retrieval document from 512 tokens to 4096 over the first half of training; dense documents
(many facts, several questions, little filler) are most frequent early, where the lookup is
learnt, and stay in the mix later.
"""
import random
import re
import subprocess

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ANSWER_W = 4
CRIT_W = 24

# Held-out names / keys for evaluation probes never appear in training documents.
NAMES = """Aaron Abigail Adam Adrian Agnes Albert Alice Amelia Amos Andrew Anna Arthur Audrey
Barbara Beatrice Benjamin Bernard Bertha Betty Caleb Camille Carl Caroline Catherine Cecil
Charles Charlotte Chloe Clara Clement Cora Daniel Daphne David Deborah Dennis Diana Dorothy
Edgar Edith Edmund Edward Eleanor Elias Eliza Ellen Emil Emily Emma Ernest Esther Ethan Eva
Felix Fiona Florence Frances Frank Frederick Gabriel George Gerald Grace Gregory Hannah Harold
Harriet Hazel Helen Henry Hugo Ida Irene Isaac Isabel Ivan Jack Jacob James Jane Jasper Jean
Joan John Jonas Joseph Judith Julia Julian Karl Kate Laura Leo Leon Lewis Lillian Linda Lois
Louis Lucy Luke Lydia Mabel Margaret Maria Martha Martin Mary Matthew Maud Max Miriam Molly
Nathan Nell Nina Noah Nora Oliver Olga Oscar Paul Pearl Peter Philip Phoebe Rachel Ralph
Rebecca Robert Rose Ruby Rufus Ruth Samuel Sarah Sophie Stella Susan Sylvia Thomas Tobias
Ursula Victor Vincent Viola Walter Wendy William Xavier Yusuf Zoe""".split()
EVAL_NAMES = """Alfred Bianca Cyrus Delia Enzo Freya Gideon Hilda Ingrid Jonah Keira Lionel
Mirabel Nestor Orla Perry Quentin Rosalind Silas Thea Ulric Vera Wilbur Yara Zane""".split()

CITIES = """Paris London Rome Cairo Lima Oslo Dublin Vienna Madrid Berlin Athens Lisbon Prague
Warsaw Boston Denver Austin Seattle Toronto Sydney Tokyo Delhi Nairobi Havana Quito Bogota
Geneva Milan Naples Munich Zurich Bristol Leeds York Glasgow Cardiff Bergen Riga Tallinn
Helsinki Kyoto Osaka Seoul Manila Jakarta Dakar Accra Tunis Algiers Rabat""".split()
COLORS = """red blue green yellow purple orange black white silver golden crimson violet
indigo amber scarlet teal brown gray pink ivory""".split()
ANIMALS = """falcon otter badger heron lynx panther sparrow tiger wolf beaver camel donkey eagle
ferret gazelle hawk ibis jackal koala lemur marten newt owl pelican quail raven salmon toad
viper walrus yak zebra bison cobra dove""".split()
ITEMS = """lamp anchor bell candle compass drum feather hammer kettle ladder mirror needle
pencil ribbon saddle shovel spoon trumpet violin wagon basket button clock glove""".split()
KEY_WORDS = """alpha bravo cedar delta ember frost gamma harbor island jade kilo lotus maple
nova onyx prism quartz river sierra tango umber vortex willow xenon yonder zephyr""".split()
EVAL_KEY_WORDS = """acorn birch coral dune elm fjord grove heath""".split()

STOP = set("""the and that shall unto for his they him them with not all thou thy thee which
were have from their this when there then upon into these said also came come hath will
what your even those because every before after over made make went them been things may
against shalt among according therefore saying ye are was but out let by be is it of in to
a as so up on or no me my we us our an at he she her its one two""".split())

BOOK_ORDER = []


def load_kjv(path=None):
    """Returns a list of (book, chapter, verse, text). path: output of
    `bible -l0 gen1:1-rev22:21`; None runs that command."""
    if path is None:
        raw = subprocess.run(["bible", "-l0", "gen1:1-rev22:21"], check=True,
                             capture_output=True, text=True).stdout
    else:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
    verses = []
    book, chap = None, None
    head = re.compile(r"^(\S.*?) (\d+)$")
    vline = re.compile(r"^\s+(\d+) (.+)$")
    for line in raw.split("\n"):
        if not line.strip():
            continue
        m = head.match(line)
        if m and not line.startswith(" "):
            book, chap = m.group(1), int(m.group(2))
            continue
        m = vline.match(line)
        if not m or book is None:
            raise ValueError("unparsed KJV line: %r" % line[:80])
        verses.append((book, chap, int(m.group(1)), m.group(2).strip()))
    if len(verses) != 31102:
        raise ValueError("expected 31102 verses, got %d" % len(verses))
    return verses


def ref(v):
    return "%s %d:%d" % (v[0], v[1], v[2])


def chatml(messages, gen_prompt=False):
    s = "".join("<|im_start|>%s\n%s<|im_end|>\n" % (r, c) for r, c in messages)
    return s + ("<|im_start|>assistant\n" if gen_prompt else "")


class Gen:
    """Document generator. tok: a tokenizers.Tokenizer; verses: load_kjv() output;
    pools (optional): precomputed token ids of every verse line in both renderings."""

    def __init__(self, tok, verses, seed, pools=None, eval_mode=False):
        self.tok = tok
        self.v = verses
        self.rng = random.Random(seed)
        self.eval_mode = eval_mode
        # every name and key word is seen in training (a token never trained cannot be
        # copied); evaluation probes differ by their random values, combinations, filler
        # and positions (a separate seed)
        # training facts never use EVAL_NAMES (the quality harness's names): the lookup must
        # work for names never seen as fact subjects (their tokens are trained through the
        # drill's mention lines); evaluation probes use both lists
        self.names = NAMES + EVAL_NAMES if eval_mode else NAMES
        self.keywords = KEY_WORDS + EVAL_KEY_WORDS
        self.eot = tok.token_to_id("<|endoftext|>")
        if pools is None:
            pools = encode_pools(tok, verses)
        self.pool_ref, self.pool_txt = pools
        self.len_txt = np.array([len(p) for p in self.pool_txt])
        self.books = {}
        for i, v in enumerate(verses):
            self.books.setdefault(v[0], []).append(i)
        self.book_names = list(self.books)
        self.first_verses = [i for i, v in enumerate(verses) if v[2] == 1]
        self.cache = {}
        self.progress = 1.0
        self.drill, self.drill_p = None, 0.0
        self.row_used = set()
        self.digit_ids = [self.enc(str(d))[0] for d in range(10)]
        self.space_id = self.enc(" ")

    def enc(self, s):
        ids = self.cache.get(s)
        if ids is None:
            ids = self.tok.encode(s, add_special_tokens=False).ids
            if len(self.cache) < 20000:
                self.cache[s] = ids
        return ids

    def enc_val(self, val):
        """Ids of " " + val (a pre-token boundary precedes it in every template)."""
        if val.isdigit():
            return self.space_id + [self.digit_ids[int(c)] for c in val]
        return self.enc(" " + val)

    def split_fact(self, line, val):
        """(prefix ids, value ids, suffix ids) of a fact line ending in val (+ "." or "\n");
        the three encodings concatenated equal the encoding of the line."""
        cut = line.rfind(" " + val)
        return (self.enc(line[:cut]), self.enc_val(val), self.enc(line[cut + 1 + len(val):]))

    def enc_fact(self, f):
        st, subj, val, line = f[:4]
        if st == "passkey":
            return self.enc(line)
        a, b, c = self.split_fact(line, val)
        return a + b + c

    # ---- pieces -------------------------------------------------------------------------
    def filler(self, n_tokens, with_refs=None):
        """Consecutive verse lines totalling at most n_tokens (list of id lists)."""
        r = self.rng
        if with_refs is None:
            with_refs = r.random() < 0.4
        pool = self.pool_ref if with_refs else self.pool_txt
        i = r.randrange(len(self.v))
        out, total = [], 0
        while True:
            p = pool[i]
            if total + len(p) > n_tokens:
                break
            out.append(p)
            total += len(p)
            i = (i + 1) % len(self.v)
        return out

    def value(self, kind):
        r = self.rng
        if kind == "code":
            return str(r.randint(1000, 99999) if r.random() < 0.3 else r.randint(1000, 9999))
        if kind == "city":
            return r.choice(CITIES)
        if kind == "color":
            return r.choice(COLORS)
        if kind == "animal":
            return r.choice(ANIMALS)
        if kind == "item":
            return r.choice(ITEMS)
        raise ValueError(kind)

    def fact(self, style, subj, val):
        """(statement line, question text, answer text) for one fact."""
        if style == "code":
            return ("The secret code of %s is %s.\n" % (subj, val),
                    "What is the secret code of %s?" % subj, val)
        if style == "city":
            return ("%s lives in %s.\n" % (subj, val), "Where does %s live?" % subj, val)
        if style == "color":
            return ("The favorite color of %s is %s.\n" % (subj, val),
                    "What is the favorite color of %s?" % subj, val)
        if style == "animal":
            return ("%s keeps a pet %s.\n" % (subj, val),
                    "What pet does %s keep?" % subj, val)
        if style == "item":
            return ("%s hid the %s in the cellar.\n" % (subj, val),
                    "What did %s hide in the cellar?" % subj, val)
        if style == "kv":
            return ("%s: %s\n" % (subj, val), "What is the value of %s?" % subj, val)
        if style == "passkey":
            return ("The pass key is %s. Remember it. %s is the pass key.\n" % (val, val),
                    "What is the pass key?", val)
        raise ValueError(style)

    def make_facts(self, n, style=None):
        r = self.rng
        if style is None:
            style = r.choice(["code", "code", "code", "kv", "kv", "passkey", "city", "color",
                              "animal", "item", "mixed", "mixed"])
        facts = []
        if style == "passkey":
            n = 1
        for _ in range(n):
            st = r.choice(["code", "code", "kv", "city", "color", "animal", "item"]) \
                if style == "mixed" else style
            if st == "kv":
                for _try in range(20):
                    if r.random() < 0.3:
                        subj = "%s-%d" % (rand_word(r, 3), r.randint(10, 999))
                    else:
                        subj = "%s-%d" % (r.choice(self.keywords), r.randint(10, 999))
                    if subj not in self.row_used:
                        break
                x = r.random()
                val = str(r.randint(1000, 9999)) if x < 0.4 else rand_word(r, 5) \
                    if x < 0.6 else "%s-%s" % (r.choice(COLORS), r.choice(ANIMALS))
            elif st == "passkey":
                subj, val = "", str(r.randint(10000, 99999))
            else:
                free = [x for x in self.names if x not in self.row_used]
                if not free:
                    self.row_used = set(subj for f in facts for subj in [f[1]])
                    free = [x for x in self.names if x not in self.row_used]
                subj = r.choice(free)
                val = self.value("code" if st == "code" else st)
            if subj:
                self.row_used.add(subj)
            facts.append((st, subj, val) + self.fact(st, subj, val))
        return facts

    # ---- documents ----------------------------------------------------------------------
    def doc_text(self, n_tokens):
        parts = self.filler(n_tokens)
        ids = [t for p in parts for t in p]
        return ids, [1] * len(ids)

    def retrieval_body(self, n_tokens, facts, intro=None):
        """Filler of about n_tokens with fact lines spliced in at random line positions."""
        r = self.rng
        fact_ids = [self.enc_fact(f) for f in facts]
        budget = n_tokens - sum(len(f) for f in fact_ids)
        if intro:
            budget -= len(intro)
        lines = self.filler(max(budget, 0))
        slots = sorted(r.randint(0, len(lines)) for _ in facts)
        order = list(range(len(facts)))
        r.shuffle(order)
        body = list(intro) if intro else []
        k = 0
        for li in range(len(lines) + 1):
            while k < len(slots) and slots[k] == li:
                body += fact_ids[order[k]]
                k += 1
            if li < len(lines):
                body += lines[li]
        return body

    def doc_retrieval(self, n_tokens, n_facts=None, n_q=None):
        """A plain-text retrieval document of at most n_tokens (n_tokens >= 200)."""
        r = self.rng
        if n_facts is None:
            n_facts = r.choice([1, 2, 3, 3, 4, 4, 6, 8])
        facts = self.make_facts(n_facts)
        if n_q is None:
            n_q = r.choice([1, 2, 3, 4])
        asked = r.sample(facts, min(len(facts), n_q))
        # the quality harness's format ("Question: ...\nAnswer: value") is the most frequent
        qstyle = r.choice(["qa", "qa", "qa", "completion", "answer_line", "mixed"])
        tail_ids, tail_w = [], []
        for f in asked:
            st, subj, val, line, q, a = f
            qs = r.choice(["qa", "qa", "completion", "answer_line"]) if qstyle == "mixed" \
                else qstyle
            if st == "kv" and qs == "completion":
                qs = "kv"
            if qs == "qa":
                pre, text = "Question: %s\nAnswer:" % q, " " + val + "\n"
            elif qs == "answer_line":
                pre, text = "Q: %s\nA:" % q, " " + sentence(st, val, line) + "\n"
            elif qs == "kv":
                pre, text = "%s:" % subj, " " + val + "\n"
            else:
                stmt = "The pass key is %s." % val if st == "passkey" else line.rstrip("\n")
                cut = stmt.rfind(" " + val)
                pre, text = stmt[:cut], stmt[cut:] + "\n"
            ids, w = self.answer(pre, text, val)
            tail_ids += ids
            tail_w += w
        body = self.retrieval_body(n_tokens - len(tail_ids) - 1, facts)
        ids = body + tail_ids
        return ids, [1] * len(body) + tail_w

    def answer(self, pre, text, val):
        """Ids and weights of a question (weight 1) and its answer text (ANSWER_W), where
        text = [copied words] + " " + val + [rest]; the first token of val that only the
        lookup can give gets CRIT_W. Each piece boundary is a pre-token boundary."""
        cut = text.rfind(" " + val)
        head, rest = text[:cut], text[cut + 1 + len(val):]
        p = self.enc(pre)
        h = self.enc(head) if head else []
        v = self.enc_val(val)
        t = self.enc(rest)
        w = [1] * len(p) + [ANSWER_W] * (len(h) + len(v) + len(t))
        w[len(p) + len(h) + (1 if val.isdigit() else 0)] = CRIT_W
        return p + h + v + t, w

    def chat_pair(self):
        """(messages without the answer, answer) for a short chat."""
        r = self.rng
        k = r.random()
        if k < 0.35:
            v = self.v[r.choice(self.first_verses) if r.random() < 0.4
                       else r.randrange(len(self.v))]
            q = r.choice(["Recite %s.", "Recite %s", "What does %s say?", "Quote %s.",
                          "What is written in %s?", "Please recite %s.",
                          "Can you tell me %s?"]) % ref(v)
            a = v[3] if r.random() < 0.7 else "%s says: %s" % (ref(v), v[3])
        elif k < 0.6:
            book = r.choice(self.book_names)
            for _try in range(10):
                i = r.choice(self.books[book])
                words = [w for w in re.findall(r"[A-Za-z]+", self.v[i][3])
                         if len(w) >= 4 and w.lower() not in STOP]
                if words:
                    break
            if not words:
                return self.chat_pair()
            w = r.choice(words)
            v = self.v[i]
            bookname = "the book of %s" % book if r.random() < 0.7 else book
            q = r.choice(["What does %s say about %s?", "What does %s say about the %s?",
                          "Tell me what %s says about %s.", "Find a verse in %s about %s."]
                         ) % (bookname, w.lower() if not w[0].isupper() or w.isupper()
                              else w)
            a = "%s says: %s" % (ref(v), v[3])
        elif k < 0.75:
            i = r.randrange(len(self.v))
            v = self.v[i]
            q = r.choice(['Where is it written, "%s"?', 'Which verse says "%s"?',
                          'Where does the Bible say "%s"?']) % v[3]
            a = r.choice(["It is written in %s.", "%s.", "That is %s."]) % ref(v)
        elif k < 0.9:
            i = r.randrange(len(self.v) - 1)
            v, w = self.v[i], self.v[i + 1]
            if (v[0], v[1]) != (w[0], w[1]):
                return self.chat_pair()
            q = r.choice(['What comes after "%s"?', 'Continue: "%s"',
                          'What is the next verse after %s?']) % \
                (v[3] if r.random() < 0.6 else ref(v))
            a = "%s %s" % (ref(w) + ":" if r.random() < 0.4 else "", w[3])
            a = a.strip()
        else:
            q, a = r.choice([
                ("Hello", "Hello! I am a small demo model trained on the King James Bible. "
                          "Ask me to recite a verse."),
                ("Hi!", "Hello! Ask me about a verse of the King James Bible."),
                ("Who are you?", "I am a small demo language model for kvserve, trained on "
                                 "the King James Version of the Bible."),
                ("What can you do?", "I can recite verses of the King James Bible, tell you "
                                     "what a book says about a word, and answer questions "
                                     "about a text you give me."),
                ("How many books are in the Bible?",
                 "The King James Bible has 66 books, from Genesis to Revelation."),
                ("What is the first book of the Bible?", "The first book is Genesis."),
                ("What is the last book of the Bible?", "The last book is Revelation."),
                ("Thank you.", "You are welcome."),
            ])
        return q, a

    def doc_chat(self, n_tokens, long_ok=True):
        """One ChatML conversation (plus <|endoftext|> appended by the packer)."""
        r = self.rng
        msgs = []
        if r.random() < 0.3:
            msgs.append(("system", "You are a helpful assistant."))
        if long_ok and n_tokens >= 256 and r.random() < 0.35:
            return self.doc_chat_retrieval(n_tokens)
        turns = 1 if r.random() < 0.7 else r.choice([2, 3])
        ids, w = [], []
        for t in range(turns):
            q, a = self.chat_pair()
            msgs.append(("user", q))
            prompt = chatml(msgs, gen_prompt=True)
            full = chatml(msgs + [("assistant", a)])
            msgs.append(("assistant", a))
            p_ids = self.enc(prompt) if t == 0 else None
            if t == 0:
                ids = list(p_ids)
                w = [1] * len(ids)
            else:
                # later turns: encode the new user turn and generation prompt alone
                # (starts at <|im_start|>, a special token: an exact boundary)
                seg = self.enc("<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n" % q)
                ids += seg
                w += [1] * len(seg)
            ans = self.enc("%s<|im_end|>" % a)
            ids += ans + self.enc("\n")
            w += [ANSWER_W] * len(ans) + [1]
            del full
        if len(ids) > n_tokens:
            return self.doc_text(n_tokens)
        return ids, w

    def doc_chat_retrieval(self, n_tokens):
        """System turn holds a passage with facts; the user asks about one."""
        r = self.rng
        facts = self.make_facts(r.choice([1, 2, 3, 4]))
        f = r.choice(facts)
        st, subj, val, line, q, a = f
        head = self.enc("<|im_start|>system\n" + r.choice(
            ["Read the following text and answer questions about it.\n",
             "You are a helpful assistant. Here is a document.\n",
             "Document:\n"]))
        qa_ids, qa_w = self.answer(
            "<|im_end|>\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n" % q,
            sentence(st, val, line) + "<|im_end|>", val)
        qa_ids, qa_w = qa_ids + self.enc("\n"), qa_w + [1]
        body = self.retrieval_body(n_tokens - len(head) - len(qa_ids) - 1, facts)
        return head + body + qa_ids, [1] * (len(head) + len(body)) + qa_w

    # ---- packing ------------------------------------------------------------------------
    def doc_length(self):
        """Length of a long retrieval document; the longest grows with self.progress."""
        r = self.rng
        top = int(512 + 3584 * min(1.0, 2 * self.progress))
        x = r.random()
        if x < 0.4:
            return r.randint(max(200, top // 2), top)
        if x < 0.7:
            return r.randint(max(200, top // 4), max(200, top // 2))
        return r.randint(200, max(200, top // 4))

    def row(self, T):
        """One training row: T+1 ids (input/target) and T+1 weights; documents separated by
        <|endoftext|>. No retrieval subject repeats within a row."""
        r = self.rng
        self.row_used = set()
        dense_p = 0.45 - 0.25 * min(1.0, 2 * self.progress)   # 0.45 early -> 0.2 late
        ids, w = [], []
        while len(ids) < T + 1:
            room = T + 1 - len(ids) - 1
            x = r.random()
            if self.drill is not None and r.random() < self.drill_p and room >= 64:
                # keeps the lookup drill (phase 1) in the mix
                d, dw = self.drill.example(room)
            elif x < dense_p and room >= 200:
                # dense lookup practice: many facts, several questions, little filler
                n = r.randint(4, 16)
                d, dw = self.doc_retrieval(min(r.randint(160, 640), room), n_facts=n,
                                           n_q=r.randint(2, min(n, 8)))
            elif x < dense_p + 0.25 and room >= 200:
                d, dw = self.doc_retrieval(min(self.doc_length(), room))
            elif x < dense_p + 0.5:
                d, dw = self.doc_chat(min(self.doc_length(), room))
            else:
                d, dw = self.doc_text(min(r.randint(128, 2048), max(room, 1)))
            if not d:
                d, dw = self.doc_text(max(room, 1)) if room > 0 else ([], [])
            ids += d + [self.eot]
            w += dw + [1]
        return ids[:T + 1], w[:T + 1]


def rand_word(r, n):
    return "".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))


def sentence(st, val, line):
    """The answer sentence of a fact in chat answers."""
    if st == "passkey":
        return "The pass key is %s." % val
    if st == "kv":
        return "The value is %s." % val
    return line.rstrip("\n")


def encode_pools(tok, verses):
    ref_lines = ["%s %s\n" % (ref(v), v[3]) for v in verses]
    txt_lines = ["%s\n" % v[3] for v in verses]
    pr = [e.ids for e in tok.encode_batch(ref_lines, add_special_tokens=False)]
    pt = [e.ids for e in tok.encode_batch(txt_lines, add_special_tokens=False)]
    return pr, pt


def eval_probe(gen, L):
    """A held-out retrieval probe of about L tokens: (prompt ids, answer ids). The answer is
    the continuation that greedy decoding must produce."""
    r = gen.rng
    facts = gen.make_facts(r.choice([1, 2, 4]))
    f = r.choice(facts)
    st, subj, val, line, q, a = f
    style = r.choice(["qa", "chat", "completion"])
    if style == "qa":
        p = gen.enc("Question: %s\nAnswer:" % q)
        full = gen.enc("Question: %s\nAnswer: %s\n" % (q, a))
        ans = full[len(p):]
        body = gen.retrieval_body(L - len(full), facts)
        return body + p, ans
    if style == "chat":
        head = gen.enc("<|im_start|>system\nRead the following text and answer questions "
                       "about it.\n")
        q_ids = gen.enc("<|im_end|>\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n"
                        % q)
        ans = gen.enc("%s<|im_end|>" % sentence(st, val, line))
        body = gen.retrieval_body(L - len(head) - len(q_ids) - len(ans), facts)
        return head + body + q_ids, ans
    if st == "kv":
        pre, tail = "%s:" % subj, " %s\n" % val
    else:
        stmt = "The pass key is %s." % val if st == "passkey" else line.rstrip("\n")
        cut = stmt.rfind(" " + val)
        pre, tail = stmt[:cut], stmt[cut:] + "\n"
    full = gen.enc(pre + tail)
    npre = len(gen.enc(pre))
    body = gen.retrieval_body(L - len(full), facts)
    return body + full[:npre], full[npre:]


def harness_probe(gen, L, lines):
    """A probe built like the quality harness's (tools/eval_retrieval.c): three facts
    "The secret code of <Name> is <NNNN>." with held-out names (the asked one in the first
    quarter of the filler lines, two distractors anywhere), filler lines of `lines` (the
    harness's filler text) from a random start, then the question. Returns (prompt ids,
    code): greedy decoding must give " " + code and then no further digit or letter."""
    r = gen.rng
    names = r.sample(EVAL_NAMES, 3)
    codes = [str(r.randint(1000, 9999)) for _ in names]
    facts = ["The secret code of %s is %s.\n" % (n, c) for n, c in zip(names, codes)]
    question = "Question: What is the secret code of %s?\nAnswer:" % names[0]
    fixed = len(gen.enc(question)) + sum(len(gen.enc(f)) for f in facts)
    start, nl, tot = r.randrange(len(lines)), 0, 0
    while True:
        n = len(gen.enc(lines[(start + nl) % len(lines)]))
        if tot + n > L - fixed:
            break
        tot += n
        nl += 1
    slots = [r.randint(0, nl // 4)] + [r.randint(0, nl) for _ in facts[1:]]
    while True:
        text = []
        for i in range(nl + 1):
            text += [f for f, s in zip(facts, slots) if s == i or (i == nl and s > nl)]
            if i < nl:
                text.append(lines[(start + i) % len(lines)])
        ids = gen.tok.encode("".join(text) + question, add_special_tokens=False).ids
        if len(ids) <= L or nl <= 4:
            return ids, codes[0]
        nl -= 1


def load_filler_lines(path):
    with open(path, encoding="utf-8") as f:
        return [ln if ln.endswith("\n") else ln + "\n" for ln in f.read().split("\n")
                if ln.strip()]


# ---- phase 1: the lookup drill ------------------------------------------------------------
# Short rows made only of facts and questions (no filler), so that nearly every step carries
# many tokens that only the key->value lookup can predict. Subjects are drawn from a large pool
# (every single-token capitalised word of the vocabulary, NAMES, two-word and made-up names),
# so the model learns to match arbitrary tokens rather than memorise a few names; EVAL_NAMES
# are never fact subjects here (they only appear in "mention" lines, so their embeddings are
# trained as names). Formats run from the easy (the value right after the key: "Name: 4821",
# where an induction head suffices) to the harness's ("The secret code of Name is 4821." then
# "Question: What is the secret code of Name?\nAnswer: 4821"); the number of facts per
# example (DRILL_FACTS) grows with progress or, when the trainer sets max_facts, only once the
# lookup is learnt at the current number (1 fact is plain copying; 2 and more need the lookup).
DRILL_FACTS = (1, 16)
SYLL = """ka ra lo mi tu ve sa no bri dor el an is ur qu om za fen gar hol ith jo ly mar nek
os pra ren sil tor ul vin wyn xa yel zor""".split()
MENTIONS = ["%s walked along the river.\n", "%s wrote a letter.\n", "And %s said, Let us go.\n",
            "%s came to the city.\n", "The house of %s was small.\n"]


class Drill:
    """Rows for the lookup drill. Weights: 0 for context (no loss), ANSWER_W for answer
    tokens, CRIT_W for the token only the lookup can predict."""

    def __init__(self, gen):
        self.g = gen
        self.r = gen.rng
        held = set(EVAL_NAMES)
        v = gen.tok.get_vocab()
        pool = set(k[1:] for k in v if k.startswith("\u0120") and len(k) >= 4 and
                   k[1].isupper() and k[2:].isalpha() and k[2:].islower())
        self.pool = sorted((pool | set(NAMES)) - held)
        self.progress = 0.0
        self.max_facts = None      # set: facts per example are 1..max_facts (the trainer's
        #                            adaptive curriculum); None: grown with progress

    def name(self):
        r = self.r
        x = r.random()
        if x < 0.75:
            return r.choice(self.pool)
        if x < 0.9:
            return "%s %s" % (r.choice(self.pool), r.choice(self.pool))
        return "".join(r.choice(SYLL) for _ in range(r.randint(2, 3))).capitalize()

    def example(self, room):
        """One example (ids, weights) of at most about `room` tokens."""
        r, g = self.r, self.g
        lo, hi = DRILL_FACTS
        top = lo + int((hi - lo) * min(1.0, 1.5 * self.progress))
        if self.max_facts is not None:
            top = min(hi, self.max_facts)
        k = r.randint(lo, max(lo, top))
        fmt = r.choice(["kv", "is", "qa", "qa", "qa", "comp", "qa_other", "qa_other"])
        subj = set()
        while len(subj) < k:
            subj.add(self.name())
        subj = list(subj)
        facts = []
        for s in subj:
            st = "code"
            if fmt == "qa_other":
                st = r.choice(["city", "color", "animal", "item", "code"])
            val = g.value(st)
            line, q, _ = g.fact(st, s, val)
            if fmt == "kv":
                line = "%s: %s\n" % (s, val)
            elif fmt == "is":
                line = "%s is %s.\n" % (s, val)
            facts.append((st, s, val, line, q))
        ids = []
        lines = [self.g.enc_fact(("x", s, val, line)) for st, s, val, line, q in facts]
        if r.random() < 0.5:
            lines.append(g.enc(r.choice(MENTIONS) % r.choice(EVAL_NAMES + NAMES)))
            r.shuffle(lines)
        for li in lines:
            ids += li
        w = [0] * len(ids)
        n_q = r.randint((k + 1) // 2, k)
        for st, s, val, line, q in r.sample(facts, n_q):
            if fmt == "kv":
                pre = "%s:" % s
            elif fmt == "is":
                pre = "%s is" % s
            elif fmt == "comp":
                pre = line[:line.rfind(" " + val)]
            else:
                pre = "Question: %s\nAnswer:" % q
            a_ids, a_w = g.answer(pre, " " + val + "\n", val)
            if len(ids) + len(a_ids) > room:
                break
            ids += a_ids
            w += [0 if x == 1 else x for x in a_w]
        return ids, w

    def row(self, T):
        ids, w = [], []
        while len(ids) < T + 1:
            d, dw = self.example(T + 1 - len(ids))
            ids += d + [self.g.eot]
            w += dw + [0]
        return ids[:T + 1], w[:T + 1]
