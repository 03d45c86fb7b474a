"""The official ``openai`` client, unchanged, against a live orchestrator serving SmolLM2-135M-Instruct.

One swarm for the module (two nodes splitting the 30 blocks, one 2-hop chain; API keys; a small per-client
queue bound so that overload is reachable). Answers are checked against the same model run locally in
transformers (float32, greedy, the same chat template).
"""
import concurrent.futures as cf
import contextlib
import functools
from pathlib import Path

import openai
import pytest
import torch

from client import SwarmClient, SwarmError
from helpers import HTTP, http_client, wait_for, wait_idle
from real_model import greedy_reference
from server.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm

MAX_LENGTH = 384
KEYS = {"sk-test": "tester", "sk-flood": "flood", "sk-admin": "admin"}
ADMIN = {"Authorization": "Bearer sk-admin"}  # operator detail of /v1/swarm (clients, queue, events)
DECLARED = {"prefill_s": 2e-4, "decode_s": 2e-3, "rtt_s": 0.002}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def local(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)

    class Local:
        name = Path(smollm2_dir).name

        @staticmethod
        def prompt_ids(text):
            return tokenizer(text, return_tensors="pt").input_ids

        @staticmethod
        def chat_text(messages):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

        greedy = staticmethod(greedy_reference(smollm2_dir))

        @staticmethod
        @functools.cache
        def model():
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()

        @staticmethod
        def logprobs(text):
            """log-softmax of the model's logits at every position of ``text`` ``(T, V)``."""
            ids = tokenizer(text, return_tensors="pt").input_ids
            with torch.inference_mode():
                return torch.log_softmax(Local.model()(ids).logits[0].float(), -1)

        @staticmethod
        def first_logprobs(text):
            return Local.logprobs(text)[-1]

    return Local


@pytest.fixture(scope="module")
def swarm(smollm2_dir):
    with LocalSwarm(smollm2_dir) as swarm:
        swarm.add_orchestrator(expected_rate=0.5, max_length=MAX_LENGTH, expected_input_tokens=64,
                               expected_output_tokens=16, refresh_s=0.5, api_keys=KEYS, max_queue_per_client=6,
                               grow_tokens=2)  # a chat without max_tokens reserves 2 output tokens at a time
        nodes = [swarm.add_node(node_id=f"n{i}", memory_gb=0.24, wait=False, declared_profile=DECLARED)
                 for i in range(2)]
        for node in nodes:
            swarm.wait_profiled(node, timeout=180)
        swarm.status = swarm.wait_chains_ready(timeout=240)
        swarm.url = swarm.orchestrator.info["url"]
        yield swarm


@pytest.fixture
def client(swarm):
    return openai.OpenAI(base_url=f"{swarm.url}/v1", api_key="sk-test", max_retries=0, timeout=180)


def test_models_list_and_retrieve(client, local):
    assert [m.id for m in client.models.list().data] == [local.name]
    assert client.models.retrieve(local.name).id == local.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_completion_answers_through_the_chat_template(client, local):
    reply = client.chat.completions.create(model=local.name, messages=QUESTION, temperature=0, max_tokens=24)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == local.greedy(local.chat_text(QUESTION), 24)
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # the template's end token ended it before max_tokens
    assert reply.usage.prompt_tokens == local.prompt_ids(local.chat_text(QUESTION)).shape[1]
    assert 0 < reply.usage.completion_tokens <= 24


def test_a_chat_without_max_tokens_grows_its_reservation_and_answers_in_full(client, local):
    """No max_tokens: the answer may run to the end of the session length, its KV reserved 2 tokens at a time
    (--grow-tokens 2); it grows past them and ends at the template's end token, as local greedy decoding does."""
    reply = client.chat.completions.create(model=local.name, messages=QUESTION, temperature=0)
    choice = reply.choices[0]
    assert choice.message.content == local.greedy(local.chat_text(QUESTION), 64)
    assert choice.finish_reason == "stop" and reply.usage.completion_tokens > 2 * 2  # two growths at least


def _preempted(url: str) -> float:
    for line in HTTP.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith('chainswarm_sessions_aborted_total{reason="preempted"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_growing_chat_on_a_full_chain_is_preempted_and_still_answers_in_full(swarm, local):
    """The chain's KV budget (capacity x 80-token slots) is taken by streamed completions except the chat's first
    reservation: when the chat's answer needs its next 16-token page there is no room, so its session is
    preempted (not ended at "length", not failed) and its rest waits in the queue; once the other sessions
    leave, it is recomputed from the prompt and the tokens so far and the answer is local greedy's, in full."""
    chains = [c for c in HTTP.get(f"{swarm.url}/v1/swarm", timeout=30).json()["chains"] if c["ready"]]
    assert len(chains) == 1 and chains[0]["active"] == 0, chains
    sea = [{"role": "user", "content": "Describe the sea in two sentences."}]  # 27 tokens: past its 3rd page
    chat_tokens = local.prompt_ids(local.chat_text(sea)).shape[1]
    free_pages = chains[0]["capacity"] * 80 // 16 - -(-(chat_tokens + 2) // 16)  # grow_tokens 2: reserves 2
    filler = "Count slowly:"
    prompt_tokens = local.prompt_ids(filler).shape[1]
    count = -(-free_pages // (MAX_LENGTH // 16))  # sessions of at most MAX_LENGTH tokens, as even as they come
    pages = [free_pages // count + (i < free_pages % count) for i in range(count)]
    assert free_pages > 0
    before = _preempted(swarm.url)
    with http_client(base_url=swarm.url, headers={"Authorization": "Bearer sk-flood"}, timeout=120) as http, \
            cf.ThreadPoolExecutor(1) as pool, \
            openai.OpenAI(base_url=f"{swarm.url}/v1", api_key="sk-test", max_retries=0, timeout=300) as client:
        readers = []
        with contextlib.ExitStack() as fillers:  # on leaving, the clients go: their sessions stop, freeing the KV
            for n in pages:  # each runs until it is closed (ignore_eos, hundreds of tokens): its KV stays held
                body = {"prompt": filler, "max_tokens": 16 * n - prompt_tokens, "temperature": 0, "stream": True,
                        "ignore_eos": True}
                stream = fillers.enter_context(http.stream("POST", "/v1/completions", json=body))
                assert stream.status_code == 200
                readers.append(stream.iter_lines())  # kept: a dropped reader closes the connection
                next(readers[-1])  # its first token: admitted and running
            answer = pool.submit(client.chat.completions.create, model=local.name, messages=sea, temperature=0)
            wait_for(lambda: _preempted(swarm.url) > before, 60, what="the chat's preemption")
            assert not answer.done()  # waiting for room, not ended
        reply = answer.result(timeout=240)
    choice = reply.choices[0]
    assert choice.message.content == local.greedy(local.chat_text(sea), 64)
    assert choice.finish_reason == "stop" and reply.usage.completion_tokens > 48 - chat_tokens


def test_chat_stream_with_usage_equals_the_plain_answer(client, local):
    stream = client.chat.completions.create(model=local.name, messages=QUESTION, temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == local.greedy(local.chat_text(QUESTION), 24)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completions_plain_streamed_and_with_a_stop_string(client, local):
    prompt = "The three primary colours are"
    expected = local.greedy(prompt, 32)
    plain = client.completions.create(model=local.name, prompt=prompt, temperature=0, max_tokens=32)
    assert plain.choices[0].text == expected and plain.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=local.name, prompt=prompt, temperature=0, max_tokens=32, stream=True))
    assert streamed == expected
    stop = expected.split()[3]  # a word in the middle of the answer: cut before it, in both modes
    cut = expected[:expected.index(stop)]
    stopped = client.completions.create(model=local.name, prompt=prompt, temperature=0, max_tokens=32, stop=[stop])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=local.name, prompt=prompt, temperature=0, max_tokens=32, stop=stop, stream=True))
    assert streamed == cut


def test_same_seed_same_text(client, local):
    def sample(seed):
        return client.chat.completions.create(model=local.name, messages=[{"role": "user", "content": "Tell me a story."}],
                                              temperature=1.0, max_tokens=24, seed=seed).choices[0].message.content
    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_logprobs_are_the_models_own(client, local):
    # one token per step in both runs: a step that verifies drafts multiplies more rows at once, which rounds the
    # float32 sums differently (a logprob's seventh digit); the stream must equal the reply bit for bit
    plain = {"speculative": False}
    reply = client.chat.completions.create(model=local.name, messages=QUESTION, temperature=0, max_tokens=4,
                                           logprobs=True, top_logprobs=3, extra_body=plain)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 4
    reference = local.first_logprobs(local.chat_text(QUESTION))
    assert abs(content[0].logprob - float(reference.max())) < 1e-3  # greedy: the chosen token is the top one
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)
    assert all(t.logprob <= 0 for entry in content for t in entry.top_logprobs)
    chunks = client.chat.completions.create(model=local.name, messages=QUESTION, temperature=0, max_tokens=4,
                                            logprobs=True, top_logprobs=3, stream=True, extra_body=plain)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    legacy = client.completions.create(model=local.name, prompt="Paris is the capital of", temperature=0,
                                       max_tokens=3, logprobs=2)
    assert len(legacy.choices[0].logprobs.token_logprobs) == 3
    assert all(len(top) == 2 for top in legacy.choices[0].logprobs.top_logprobs)


def test_echo_scores_the_prompt_as_transformers_does(client, local):
    """``echo`` with ``logprobs`` (what lm-evaluation-harness sends for log-likelihoods): every prompt token's
    log-probability after the ones before it, computed through the chain, equal to local transformers'; the first
    token has none. With max_tokens 0 nothing is generated; with more, the answer follows the echoed prompt."""
    prompt = "Paris is the capital of France, and Berlin is the capital of"
    ids = local.prompt_ids(prompt)[0].tolist()
    reference = local.logprobs(prompt)
    scored = client.completions.create(model=local.name, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice, logprobs = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == prompt and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(logprobs.tokens) == len(ids) and "".join(logprobs.tokens) == prompt
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(ids))]
    for t in range(1, len(ids)):
        assert logprobs.token_logprobs[t] == pytest.approx(float(reference[t - 1, ids[t]]), abs=1e-3)
        best = reference[t - 1].topk(2).values.tolist()
        assert sorted(logprobs.top_logprobs[t].values(), reverse=True) == pytest.approx(best, abs=1e-3)
    # lm-evaluation-harness's request: echo and one token
    answer = local.greedy(prompt, 3)
    one = client.completions.create(model=local.name, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                    temperature=0)
    assert one.choices[0].text == prompt + local.greedy(prompt, 1) and answer.startswith(" Germany")
    assert one.choices[0].logprobs.token_logprobs[:len(ids)] == pytest.approx(logprobs.token_logprobs, abs=1e-5)
    assert len(one.choices[0].logprobs.tokens) == len(ids) + 1
    # streamed: the echoed prompt first, then the answer; every logprob with the choice's last chunk
    chunks = list(client.completions.create(model=local.name, prompt=prompt, max_tokens=3, echo=True, logprobs=1,
                                            temperature=0, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == prompt and "".join(texts) == prompt + answer
    last = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(last) == 1 and len(last[0].tokens) == len(ids) + 3 and last[0].token_logprobs[0] is None
    # the one token of echo + logprobs + max_tokens 1 is chosen from the scoring prefill's last position, with the
    # request's own sampling: the token and logprob the plain request draws with the same seed
    drawn, opening = set(), "My favourite word is"
    for seed in (3, 4, 5):
        sampled = dict(model=local.name, max_tokens=1, logprobs=1, temperature=1.5, seed=seed)
        echoed = client.completions.create(prompt=opening, echo=True, **sampled).choices[0]
        alone = client.completions.create(prompt=opening, **sampled).choices[0]
        assert echoed.text == opening + alone.text
        assert echoed.logprobs.token_logprobs[-1] == pytest.approx(alone.logprobs.token_logprobs[0], abs=1e-4)
        drawn.add(alone.text)
    assert len(drawn) >= 2  # the seeds drew different tokens: not the argmax every time
    # echo alone costs nothing; max_tokens 0 without it is refused
    plain = client.completions.create(model=local.name, prompt=prompt, max_tokens=0, echo=True, n=2)
    assert [c.text for c in plain.choices] == [prompt, prompt] and plain.choices[0].logprobs is None
    chunks = list(client.completions.create(model=local.name, prompt=[prompt, "Water"], max_tokens=0, echo=True, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    assert [(c.choices[0].index, c.choices[0].text) for c in chunks if c.choices] == [
        (0, prompt), (1, prompt), (2, "Water"), (3, "Water")]
    assert chunks[-1].usage.prompt_tokens == len(ids) + len(local.prompt_ids("Water")[0])
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=local.name, prompt=prompt, max_tokens=0)


def test_score_cli_gives_transformers_perplexity(swarm, local, smollm2_dir):
    """``chainswarm score``: the fixed paragraph's perplexity through the swarm (one prefill through the chain,
    the LM head at the orchestrator) equals local transformers' (float32)."""
    import json
    import subprocess
    import sys

    from real_model import paragraph, perplexity
    from transformers import AutoTokenizer

    text = paragraph()
    run = subprocess.run([sys.executable, "-m", "swarm.cli", "score", "-", "--orchestrator", swarm.url,
                          "--api-key", "sk-test", "--top", "2", "--json"], input=text, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    expected = perplexity(local.model(), AutoTokenizer.from_pretrained(smollm2_dir), text)
    assert doc["scored_tokens"] == len(local.prompt_ids(text)[0]) - 1 >= 100
    assert doc["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert all(len(top) == 2 for top in doc["top"][1:]) and doc["top"][0] is None


def test_a_batch_of_prompts_as_text_or_token_ids(client, local):
    """A completions request with several prompts, as text or as token ids (lm-evaluation-harness's
    ``local-completions`` sends ``[[ids...], ...]``): n choices per prompt, in prompt order, each the prompt's own."""
    first, second = "Paris is the capital of France, and Berlin is the capital of", "The three primary colours are"
    ids = [local.prompt_ids(p)[0].tolist() for p in (first, second)]
    scored = client.completions.create(model=local.name, prompt=ids, max_tokens=1, echo=True, logprobs=1,
                                       temperature=0)
    assert [c.index for c in scored.choices] == [0, 1]
    assert [c.text for c in scored.choices] == [p + local.greedy(p, 1) for p in (first, second)]
    assert [len(c.logprobs.token_logprobs) for c in scored.choices] == [len(i) + 1 for i in ids]
    assert scored.usage.prompt_tokens == sum(map(len, ids)) and scored.usage.completion_tokens == 2
    texts = client.completions.create(model=local.name, prompt=[first, second], max_tokens=4, temperature=0, n=2)
    assert [c.text for c in texts.choices] == [local.greedy(first, 4)] * 2 + [local.greedy(second, 4)] * 2
    with pytest.raises(openai.BadRequestError, match="not in the model's vocabulary"):
        client.completions.create(model=local.name, prompt=[ids[0] + [10 ** 7]], max_tokens=1)
    # streamed: the choices' chunks interleave, each with its index (p·n + i), each prompt scored by a run of its
    # own (echo with logprobs and n 2); each choice's last chunk has its prompt's and answer's logprobs; one usage
    chunks = list(client.completions.create(model=local.name, prompt=[first, second], max_tokens=4, temperature=0,
                                            n=2, stream=True, echo=True, logprobs=1,
                                            stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert streamed == [first + local.greedy(first, 4)] * 2 + [second + local.greedy(second, 4)] * 2
    assert len({c.id for c in chunks}) == 1
    ends = {c.choices[0].index: c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason}
    assert sorted(ends) == [0, 1, 2, 3] and chunks[-1].usage.completion_tokens == 16
    assert [len(ends[i].logprobs.tokens) for i in range(4)] == [len(ids[i // 2]) + 4 for i in range(4)]
    assert ends[2].logprobs.token_logprobs[1:len(ids[1])] == pytest.approx(
        scored.choices[1].logprobs.token_logprobs[1:len(ids[1])], abs=1e-4)
    assert chunks[-1].usage.prompt_tokens == sum(map(len, ids))


def test_n_choices_are_separate_sessions(client, local, swarm):
    reply = client.chat.completions.create(model=local.name, messages=QUESTION, temperature=0, max_tokens=12, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content == reply.choices[1].message.content
    status = HTTP.get(f"{swarm.url}/v1/swarm", headers=ADMIN, timeout=30).json()
    assert status["clients"]["tester"]["service"] > 0  # both sessions were charged to the client


def test_unsupported_and_unknown_fields(client, local, swarm):
    with pytest.raises(openai.BadRequestError, match="functions") as refused:  # the deprecated form of tools
        client.chat.completions.create(model=local.name, messages=QUESTION,
                                       extra_body={"functions": [{"name": "f", "parameters": {}}]})
    assert (refused.value.code, refused.value.param, refused.value.type) == (
        "unsupported_parameter", "functions", "invalid_request_error")
    # what applications check to shorten a conversation, as they do with OpenAI's
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=local.name, messages=QUESTION, max_tokens=MAX_LENGTH)
    assert (too_long.value.code, too_long.value.param, too_long.value.type) == (
        "context_length_exceeded", "messages", "invalid_request_error")
    with pytest.raises(SwarmError) as too_long_here:  # the client library reads the same code
        with SwarmClient(swarm.url, api_key="sk-test") as c:
            c.generate("Hello", MAX_LENGTH)
    assert (too_long_here.value.status, too_long_here.value.code, too_long_here.value.param) == (
        400, "context_length_exceeded", "prompt")
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=1)
    assert (unknown.value.code, unknown.value.param) == ("model_not_found", "model")
    response = HTTP.post(f"{swarm.url}/v1/chat/completions", headers={"Authorization": "Bearer sk-test"},
                         json={"messages": QUESTION, "colour": "red"}, timeout=30)
    assert response.status_code == 400 and "colour" in response.json()["error"]["message"]
    response = HTTP.get(f"{swarm.url}/health", headers={"X-Request-Id": "trace-me"}, timeout=30)
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-me"
    assert HTTP.get(f"{swarm.url}/ready", timeout=30).json()["ready"] is True


def test_overload_ends_in_answers_or_429s_with_retry_after_and_nothing_is_lost(swarm, local):
    # the module's earlier tests left nothing running (a slot they kept would be this test's failure below)
    wait_idle(swarm.url, ADMIN, 30, "an idle swarm before the overload")
    capacity = sum(c["capacity"] for c in swarm.status["chains"])
    count = 4 * capacity  # all at once: past the chains and the client's queue bound (6) whatever the capacity
    assert count > capacity + 6
    prompt = "Water boils at"
    expected = local.greedy(prompt, 4)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}

    def one(_):
        return HTTP.post(f"{swarm.url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-flood"},
                         timeout=300)

    def patient():  # the client library waits as told by Retry-After and gets its answer
        with SwarmClient(swarm.url, api_key="sk-flood", retries=20) as c:
            return c.generate(prompt, 4, temperature=0).text

    with cf.ThreadPoolExecutor(count + 1) as pool:
        waiting = pool.submit(patient)
        responses = list(pool.map(one, range(count)))
        assert waiting.result(timeout=300) == expected
    answered = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(answered) + len(refused) == count
    assert answered and refused
    assert all(r.json()["choices"][0]["text"] == expected for r in answered)
    assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["message"] for r in refused)

    wait_idle(swarm.url, ADMIN, 30, "an idle swarm after the overload")
