"""Token probabilities, logit biases, several choices and prompts, and the prompt's progress
through `speculate serve`, on the default target (Qwen2.5-Coder 1.5B) with two slots: the
official openai client's `logprobs` and `n`, llama-server's `n_probs`, `post_sampling_probs`,
`logit_bias`, `n_cmpl`, several prompts and `return_progress`. Probabilities are the target's
at every emitted token, drafted or not: the same with speculation (the server's auto) as
without (`speculative.type` none, per request).
"""

from __future__ import annotations

import pytest

from tests.conftest import QWEN
from tests.test_serve import sse, start_server, stop_server

pytestmark = pytest.mark.real

ASK = [{"role": "user", "content": "Write a Python function that returns the sum of a list of numbers."}]
CODE = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
NONE = {"speculative.type": "none"}


@pytest.fixture(scope="module")
def qwen(model_path, tmp_path_factory):
    s = start_server(model_path, tmp_path_factory.mktemp("probs"), "-c", "4096", "-np", "2", "--temp", "0",
                     model=str(model_path(QWEN)))
    yield s
    stop_server(s)


def chat(server, **body):
    return server.client().chat.completions.create(model="any", messages=ASK, max_tokens=48, **body)


def test_chat_logprobs_are_each_tokens_and_the_same_with_and_without_speculation(qwen, batch_invariant):
    alone = chat(qwen, logprobs=True, top_logprobs=5, extra_body=NONE)
    drafted = chat(qwen, logprobs=True, top_logprobs=5)  # auto drafts from what the first answer wrote (the pool)
    choice = drafted.choices[0]
    assert drafted.timings["draft_n_accepted"] > 0  # drafted tokens were accepted: their logprobs are here too
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    assert drafted.usage.completion_tokens == len(content)
    for token in content:
        assert token.logprob <= 0 and bytes(token.bytes).decode(errors="ignore") == token.token
        assert len(token.top_logprobs) == 5 and token.top_logprobs[0].token == token.token  # greedy: the argmax
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
    assert alone.choices[0].message.content == choice.message.content
    assert [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in content] == \
        [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in alone.choices[0].logprobs.content]


def test_streamed_logprobs_come_with_the_text_they_carry(qwen):
    whole = chat(qwen, logprobs=True, top_logprobs=2)
    text, tokens = "", []
    for chunk in qwen.client().chat.completions.create(model="any", messages=ASK, max_tokens=48, logprobs=True,
                                                        top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].finish_reason is None and chunk.choices[0].delta.role is None:
            text += chunk.choices[0].delta.content or ""
            tokens += chunk.choices[0].logprobs.content
    assert text == whole.choices[0].message.content == "".join(t.token for t in tokens)
    assert [t.logprob for t in tokens] == [t.logprob for t in whole.choices[0].logprobs.content]


def test_completion_logprobs_in_both_of_openais_shapes(qwen):
    answer = qwen.client().completions.create(model="any", prompt=CODE, max_tokens=24, logprobs=3)
    logprobs = answer.choices[0].logprobs
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert logprobs.token_logprobs == [e["logprob"] for e in logprobs.content]
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_n_choices_each_its_own_stream_the_prompt_processed_once(qwen):
    answer = chat(qwen, n=2, temperature=1.0, seed=5)
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].message.content != answer.choices[1].message.content  # two random streams
    again = chat(qwen, n=2, temperature=1.0, seed=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in answer.choices]
    assert answer.usage.prompt_tokens == chat(qwen).usage.prompt_tokens  # the prompt's tokens once
    prompt = "# one prompt, two answers\n" + CODE * 4
    status, _, answers = qwen.request("POST", "/completion", {"prompt": prompt, "n_predict": 8, "n_cmpl": 2,
                                                             "temperature": 0})
    assert status == 200 and [a["index"] for a in answers] == [0, 1]
    first, second = (a["timings"] for a in answers)
    assert answers[0]["content"] == answers[1]["content"]  # greedy: the same answer from either slot
    n_prompt = first["prompt_n"] + first["cache_n"]
    assert first["prompt_n"] > 16 and second["cache_n"] == n_prompt - 1  # the second restored the first's prompt


def test_streamed_choices_carry_their_index_and_end_with_one_usage(qwen):
    chunks = sse(qwen, "/v1/chat/completions", {"messages": ASK, "max_tokens": 16, "n": 2, "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]"
    chunks = chunks[:-1]
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts[0] and texts[0] == texts[1]  # greedy
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 32
    assert sum(1 for c in chunks if c.get("usage")) == 1


def test_several_prompts_in_one_request_an_answer_each(qwen):
    prompts = [CODE, "def quicksort(arr):\n"]
    status, _, answers = qwen.request("POST", "/completion", {"prompt": prompts, "n_predict": 12, "temperature": 0})
    alone = [qwen.request("POST", "/completion", {"prompt": p, "n_predict": 12, "temperature": 0})[2]["content"]
             for p in prompts]
    assert status == 200 and [a["content"] for a in answers] == alone
    answer = qwen.client().completions.create(model="any", prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(answer.choices, key=lambda c: c.index)] == alone


def test_n_probs_and_post_sampling_probs_as_llama_server_writes_them(qwen):
    _, _, raw = qwen.request("POST", "/completion", {"prompt": CODE, "n_predict": 6, "n_probs": 4, "temperature": 0})
    assert len(raw["completion_probabilities"]) == 6
    for entry in raw["completion_probabilities"]:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 4 and entry["top_logprobs"][0]["id"] == entry["id"]
    _, _, post = qwen.request("POST", "/completion", {"prompt": CODE, "n_predict": 6, "n_probs": 4, "seed": 1,
                                                      "temperature": 1.0, "post_sampling_probs": True})
    for entry in post["completion_probabilities"]:
        probs = [t["prob"] for t in entry["top_probs"]]
        assert 0 < entry["prob"] <= 1 and all(0 < p <= 1 for p in probs) and len(probs) <= 4
        assert len(probs) == 4 or sum(probs) == pytest.approx(1.0)  # fewer only when they are all there is
    streamed = sse(qwen, "/completion", {"prompt": CODE, "n_predict": 6, "n_probs": 2, "temperature": 0,
                                         "stream": True})
    pieces = [c for c in streamed if not c["stop"]]
    assert all(len(c["completion_probabilities"]) == 1 == len(c["tokens"]) for c in pieces)  # a chunk a token
    assert [c["completion_probabilities"][0]["id"] for c in pieces] == [e["id"] for e in raw["completion_probabilities"]]


def test_a_logit_bias_bans_and_shows_in_generation_settings(qwen):
    _, _, first = qwen.request("POST", "/completion", {"prompt": CODE, "n_predict": 16, "temperature": 0,
                                                       "return_tokens": True})
    banned = first["tokens"][0]
    for bias in ([[banned, False]], {str(banned): -100}):
        _, _, answer = qwen.request("POST", "/completion", {"prompt": CODE, "n_predict": 16, "temperature": 0,
                                                            "return_tokens": True, "logit_bias": bias})
        assert banned not in answer["tokens"]
        assert answer["generation_settings"]["logit_bias"][0]["token"] == banned
    answer = qwen.client().completions.create(model="any", prompt=CODE, max_tokens=16, temperature=0,
                                              logit_bias={str(banned): -100}, logprobs=0)
    assert banned not in [e["id"] for e in answer.choices[0].logprobs.content]


def test_the_prompts_progress_before_the_answer(qwen):
    body = {"prompt": CODE * 60, "n_predict": 4, "stream": True, "return_progress": True, "cache_prompt": False}
    chunks = sse(qwen, "/completion", body)
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert len(progress) >= 2 and progress[0]["processed"] == progress[0]["cache"]
    assert [p["processed"] for p in progress] == sorted({p["processed"] for p in progress})
    assert progress[-1]["processed"] == progress[-1]["total"] > 512  # several batches (-b 512)
    assert chunks.index(next(c for c in chunks if "prompt_progress" in c)) == 0
    chat_chunks = sse(qwen, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "stream": True,
                                                     "return_progress": True})
    reported = [c for c in chat_chunks if "prompt_progress" in c]
    assert reported and reported[-1]["prompt_progress"]["processed"] == reported[-1]["prompt_progress"]["total"]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": None} for c in reported)


@pytest.mark.parametrize("path, body, where", [
    ("/v1/chat/completions", {"messages": ASK, "n": 3}, "n"),
    ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/completion", {"prompt": "x", "n_cmpl": 3}, "n"),
    ("/completion", {"prompt": "x", "logit_bias": [[10**9, 1]]}, "logit_bias"),
])
def test_more_choices_than_slots_or_bad_probabilities_are_400s_and_the_server_goes_on(qwen, path, body, where):
    status, _, error = qwen.request("POST", path, body)
    assert status == 400 and where in str(error)
    assert chat(qwen).choices[0].message.content
