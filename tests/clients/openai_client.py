"""The official `openai` Python package against a running dflash-serve.

Checks chat and completions, streamed and not, the usage chunk, model listing, that a greedy
stream spells exactly the non-streamed answer, and `response_format`, `tools` / `tool_choice`,
`logprobs` and completions `echo`. Exits non-zero on the first failure.
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
    structured_tools_and_logprobs(client, model)


def structured_tools_and_logprobs(client: OpenAI, model: str) -> None:
    """`response_format`, `tools` with `tool_choice` and `logprobs` through the client's own
    types (the server runs with --tool-call-parser qwen25)."""
    import json

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "size": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["name", "size"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Describe a file as JSON."}]
    chat = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "file", "schema": schema}},
    )
    obj = json.loads(chat.choices[0].message.content)
    assert set(obj) == {"name", "size"} and isinstance(obj["size"], int), obj

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather of a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        r = client.chat.completions.create(
            model=model, messages=ask, tools=tools, tool_choice=choice, max_tokens=400, temperature=0
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", r
        calls = c.message.tool_calls
        assert calls and calls[0].function.name == "get_weather", r
        assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Tokyo"), calls
        names, args = [], {}
        for chunk in client.chat.completions.create(
            model=model, messages=ask, tools=tools, tool_choice=choice, max_tokens=400,
            temperature=0, stream=True,
        ):
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    if d.function and d.function.name:
                        names.append(d.function.name)
                    if d.function and d.function.arguments:
                        args[d.index] = args.get(d.index, "") + d.function.arguments
        assert names == [c.function.name for c in calls], (names, calls)
        streamed = [json.loads(args[i]) for i in sorted(args)]
        assert streamed == [json.loads(c.function.arguments) for c in calls], (args, calls)

    lp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == 8, content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2, t
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob, t
    prompt = "def fibonacci(n):"
    echo = client.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True,
        extra_body={"ignore_eos": True},
    )
    c = echo.choices[0]
    assert c.text.startswith(prompt), c.text
    assert c.logprobs.token_logprobs[0] is None, c.logprobs
    assert all(x <= 0 for x in c.logprobs.token_logprobs[1:]), c.logprobs
    assert "".join(c.logprobs.tokens) == c.text, (c.logprobs.tokens, c.text)
    print("openai client: response_format, tools (required, named, streamed), logprobs, echo OK")

    resp = client.responses.create(
        model=model, input="Write a loop.", max_output_tokens=12, temperature=0,
        instructions="Answer with code.",
    )
    assert resp.output_text, resp
    assert resp.usage.output_tokens <= 12, resp.usage
    kinds, deltas, final = [], [], None
    for event in client.responses.create(
        model=model, input="Write a loop.", max_output_tokens=12, temperature=0,
        instructions="Answer with code.", stream=True,
    ):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[0] == "response.created" and final is not None, kinds
    assert "".join(deltas) == final.output_text == resp.output_text, (deltas, final, resp)
    print("openai client: responses (whole and streamed) OK")


if __name__ == "__main__":
    main(sys.argv[1].rstrip("/"))
