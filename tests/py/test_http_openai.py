"""The official openai client against the daemon: completions, chat, streaming with usage,
n > 1, logprobs, stop, and errors surfacing as the SDK's typed exceptions."""
import openai

from kvs_http import Server, check, chatml, complete, tokenize

KEY = "sk-test-123"


def main():
    with Server("--api-key", KEY, env={"KVS_FAKE_STEP_MS": "2"}) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0, timeout=30)

        models = client.models.list()
        check(len(models.data) == 1 and models.data[0].id == "fake", f"models: {models}")
        model = models.data[0].id
        card = client.models.retrieve(model)
        check(card.id == model and card.object == "model", f"retrieve {card}")

        # completions, exact text from the independent model of the fake backend
        prompt = "The quick brown fox"
        r = client.completions.create(model=model, prompt=prompt, max_tokens=7)
        want, reason, n = complete(tokenize(prompt), 7)
        check(r.choices[0].text == want, f"text {r.choices[0].text!r} != {want!r}")
        check(r.choices[0].finish_reason == reason == "length", f"finish {r.choices[0].finish_reason}")
        check(r.usage.prompt_tokens == len(tokenize(prompt)) and r.usage.completion_tokens == n
              and r.usage.total_tokens == r.usage.prompt_tokens + n, f"usage {r.usage}")
        check(r.object == "text_completion" and r.id.startswith("cmpl-"), "completion id/object")

        # stop string: finish_reason stop, the stop text not included
        r = client.completions.create(model=model, prompt="abcdef", max_tokens=6, stop=["cb"])
        want, reason, _ = complete(tokenize("abcdef"), 6, stop=["cb"])
        check((r.choices[0].text, r.choices[0].finish_reason) == (want, "stop") and want == "fed",
              f"stop: {r.choices[0]}")

        # EOS in the prompt -> the fake emits it -> finish stop
        p = "xy<|endoftext|>ab"
        r = client.completions.create(model=model, prompt=p, max_tokens=20)
        want, reason, _ = complete(tokenize(p), 20)
        check((r.choices[0].text, r.choices[0].finish_reason) == (want, "stop"), f"eos: {r.choices[0]}")

        # several prompts, n=2 each: 4 choices, indices in order, prompt tokens counted per prompt
        prompts = ["hello", "world!"]
        r = client.completions.create(model=model, prompt=prompts, max_tokens=3, n=2)
        check(len(r.choices) == 4, f"choices {len(r.choices)}")
        for c in r.choices:
            exp = complete(tokenize(prompts[c.index // 2]), 3)[0]
            check(c.text == exp, f"choice {c.index}: {c.text!r} != {exp!r}")
        check(r.usage.prompt_tokens == sum(len(tokenize(p)) for p in prompts), f"usage {r.usage}")
        check(r.usage.completion_tokens == 12, f"usage {r.usage}")

        # token-id prompt
        r = client.completions.create(model=model, prompt=[104, 105, 33], max_tokens=3)
        check(r.choices[0].text == "!ih", f"ids prompt: {r.choices[0].text!r}")

        # logprobs (completions: int)
        r = client.completions.create(model=model, prompt="abc", max_tokens=2, logprobs=2)
        lp = r.choices[0].logprobs
        check(lp.tokens == ["c", "b"] and len(lp.token_logprobs) == 2 and len(lp.top_logprobs) == 2
              and lp.text_offset == [0, 1], f"logprobs {lp}")
        check(abs(lp.token_logprobs[0] + 0.6931) < 1e-3, f"logprob {lp.token_logprobs}")

        # chat
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi there"}]
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=5)
        ids = tokenize(chatml(msgs), add_special=False)
        want, reason, n = complete(ids, 5)
        check(r.choices[0].message.content == want and r.choices[0].message.role == "assistant",
              f"chat {r.choices[0].message}")
        check(r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n, f"chat usage {r.usage}")
        check(r.object == "chat.completion", "chat object")

        # chat logprobs
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=3, logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        check(len(content) == 3 and len(content[0].top_logprobs) == 2, f"chat logprobs {content}")

        # streaming chat with include_usage
        stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, stream=True,
                                                stream_options={"include_usage": True})
        text, roles, finish, usage, nchunks = "", [], None, None, 0
        for ch in stream:
            nchunks += 1
            if ch.usage is not None:
                usage = ch.usage
                check(ch.choices == [], "usage chunk must have no choices")
                continue
            d = ch.choices[0].delta
            if d.role:
                roles.append(d.role)
            text += d.content or ""
            if ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
        want, reason, n = complete(ids, 6)
        check(text == want and finish == reason, f"stream text {text!r} {finish} != {want!r} {reason}")
        check(roles == ["assistant"], f"roles {roles}")
        check(usage is not None and usage.completion_tokens == n and usage.prompt_tokens == len(ids),
              f"stream usage {usage}")

        # streaming completions without usage
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=4, stream=True)
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        check(text == complete(tokenize(prompt), 4)[0], f"completion stream {text!r}")
        check(chunks[-1].choices[0].finish_reason == "length", "last chunk finish_reason")
        check(all(c.usage is None for c in chunks), "no usage without include_usage")

        run_errors(srv, client, model)
    # 429: one running slot, one waiting slot, slow steps: the third concurrent request is refused
    with Server("--api-key", KEY, "--max-waiting", "1", "--max-running", "1", env={"KVS_FAKE_STEP_MS": "20"}) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0, timeout=30)
        s1 = client.completions.create(model="fake", prompt="aaaa", max_tokens=200, stream=True)
        next(iter(s1))
        s2 = client.completions.create(model="fake", prompt="bbbb", max_tokens=200, stream=True)
        e = expect(openai.RateLimitError, lambda: client.completions.create(model="fake", prompt="c", max_tokens=1),
                   "rate_limit_exceeded")
        check(e.response.headers.get("retry-after") == "1", "Retry-After on 429")
        s1.close()
        s2.close()
    print("openai client: completions, chat, streaming+usage, n, logprobs, stop, typed errors: ok")


def expect(exc, fn, code=None):
    try:
        fn()
    except exc as e:
        if code is not None:
            check(e.code == code, f"{exc.__name__}: code {e.code!r} != {code!r}")
        return e
    raise AssertionError(f"expected {exc.__name__}")


def run_errors(srv, client, model):
    e = expect(openai.BadRequestError,
               lambda: client.completions.create(model=model, prompt="x" * 200, max_tokens=100),
               "context_length_exceeded")
    check("maximum context length is 256 tokens" in str(e), f"message: {e}")
    expect(openai.BadRequestError, lambda: client.completions.create(model=model, prompt="x", temperature=5))
    expect(openai.NotFoundError, lambda: client.completions.create(model="gpt-9", prompt="x"), "model_not_found")
    expect(openai.NotFoundError, lambda: client.models.retrieve("gpt-9"), "model_not_found")
    bad = openai.OpenAI(base_url=srv.base + "/v1", api_key="wrong", max_retries=0)
    expect(openai.AuthenticationError, lambda: bad.models.list(), "invalid_api_key")


if __name__ == "__main__":
    main()
