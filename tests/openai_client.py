"""Drives a running `dppo serve` with the official `openai` client: models, completions,
chat, streaming, n > 1, logprobs and error mapping. Exits non-zero on the first failure.

Usage: python3 tests/openai_client.py <base_url> <model>
"""

import sys

from openai import BadRequestError, NotFoundError, OpenAI


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")


def main():
    base_url, model = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)

    ids = [m.id for m in client.models.list().data]
    check(ids == [model], f"models.list: {ids}")

    # Completions, whole and streamed: the stream concatenates to the whole text.
    args = dict(model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    whole = client.completions.create(**args)
    text = whole.choices[0].text
    check(whole.choices[0].finish_reason in ("stop", "length"), whole)
    u = whole.usage
    check(u.completion_tokens >= 1 and u.total_tokens == u.prompt_tokens + u.completion_tokens, u)
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **args) if c.choices]
    check("".join(pieces) == text, f"completion stream {pieces!r} != {text!r}")

    # Chat, whole and streamed with usage.
    args = dict(
        model=model,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=12,
        temperature=0,
    )
    whole = client.chat.completions.create(**args)
    answer = whole.choices[0].message.content
    check(whole.choices[0].message.role == "assistant", whole)
    pieces, usage = [], None
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **args
    )
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
    check("".join(pieces) == answer, f"chat stream {pieces!r} != {answer!r}")
    check(usage is not None and usage.completion_tokens == whole.usage.completion_tokens, usage)

    # n > 1, sampled and seeded: reproducible, one choice per index.
    args = dict(
        model=model,
        messages=[{"role": "user", "content": "Count: 1, 2,"}],
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=8,
    )
    first = client.chat.completions.create(**args)
    again = client.chat.completions.create(**args)
    check(sorted(c.index for c in first.choices) == [0, 1, 2], first)
    check(
        [c.message.content for c in first.choices] == [c.message.content for c in again.choices],
        "seeded n > 1 is not reproducible",
    )

    # Logprobs: legacy completions lists, chat entries with alternatives; greedy picks
    # the most likely alternative.
    c = client.completions.create(
        model=model, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 1, lp)
    check("".join(lp.tokens) == c.choices[0].text, lp)
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    for e in r.choices[0].logprobs.content:
        best = max(t.logprob for t in e.top_logprobs)
        check(len(e.top_logprobs) == 3 and abs(e.logprob - best) < 1e-4, e)

    # Errors arrive as the client's typed exceptions.
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        check(False, "an unknown model was accepted")
    except NotFoundError as e:
        check("does not exist" in str(e), e)
    try:
        client.completions.create(model=model, prompt="x", temperature=-1)
        check(False, "a negative temperature was accepted")
    except BadRequestError as e:
        check("temperature" in str(e), e)
    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
