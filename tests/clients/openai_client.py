"""The official `openai` Python package against a running dflash-serve.

Checks chat and completions, streamed and not, the usage chunk, model listing, and that a
greedy stream spells exactly the non-streamed answer. Exits non-zero on the first failure.
Usage: python openai_client.py http://127.0.0.1:PORT
"""

import sys

import openai
from openai import OpenAI


def main(base: str) -> None:
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    models = client.models.list().data
    assert len(models) == 1, models
    model = models[0].id
    print(f"openai {openai.__version__}: model {model}")

    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    extra = {"ignore_eos": True}
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, extra_body=extra
    )
    answer = chat.choices[0].message.content
    assert answer, chat
    assert chat.choices[0].finish_reason == "length", chat
    assert chat.usage.completion_tokens == 24, chat.usage
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 24, chat.usage

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    parts, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert roles == ["assistant"], roles
    assert "".join(parts) == answer, ("".join(parts), answer)
    assert finish == "length", finish
    assert usage is not None and usage.completion_tokens == 24, usage

    prompt = "def fibonacci(n):"
    comp = client.completions.create(
        model=model, prompt=prompt, max_tokens=20, temperature=0, extra_body=extra
    )
    text = comp.choices[0].text
    assert text and comp.usage.completion_tokens == 20, comp
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body=extra
        )
        if c.choices
    )
    assert streamed == text, (streamed, text)

    try:
        client.chat.completions.create(model=model, messages=messages, temperature=-1)
        raise AssertionError("temperature -1 was accepted")
    except openai.BadRequestError as e:
        assert "temperature" in str(e), e
    # SGLang serves any `model` string; the answer names the served model.
    other = client.chat.completions.create(
        model="no-such-model", messages=messages, max_tokens=4, temperature=0
    )
    assert other.model == model, (other.model, model)
    assert other.choices[0].message.content is not None, other
    print("openai client: chat, completions, streaming, usage, errors and any model name OK")


if __name__ == "__main__":
    main(sys.argv[1].rstrip("/"))
