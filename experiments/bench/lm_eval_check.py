"""lm-evaluation-harness against the swarm: a multiple-choice task scored through the orchestrator's HTTP API by
lm-eval's own ``local-completions`` model, unmodified, and every log-likelihood compared with local transformers.

    python -m experiments.bench.lm_eval_check      # about 3 minutes; writes experiments/results/lm_eval_check.json

1. builds (once) a throwaway environment with ``lm_eval[api]`` (``--lm-eval-venv``, uv, packages from PyPI only);
2. starts a local swarm as a user would: a DHT, an orchestrator with default options and two nodes of 0.3 GB that
   split SmolLM2-135M-Instruct (float32) between them;
3. writes a small multiple-choice task (:data:`QUESTIONS`, a local JSON-lines file: no dataset hub) and runs
   ``lm_eval --model local-completions`` on it with ``tokenized_requests`` (lm-eval's default: prompts as token ids,
   ``echo``, ``logprobs`` 1, ``max_tokens`` 1), ``--log_samples``;
4. recomputes each (context, continuation) log-likelihood from the same token ids in local transformers (float32)
   and reports the largest difference, the greedy flags and both accuracies.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LM_EVAL = "lm_eval[api]==0.4.13"
RESULTS = Path(__file__).resolve().parents[1] / "results"
DTYPE = "float32"
NODE_GB = 0.3
# (question, choices, index of the right one): facts a 135M model mostly knows, and some it does not
QUESTIONS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("The capital of Italy is", ["Vienna", "Rome", "Athens", "Lisbon"], 1),
    ("The capital of Japan is", ["Seoul", "Beijing", "Tokyo", "Bangkok"], 2),
    ("The largest planet in the solar system is", ["Mars", "Venus", "Earth", "Jupiter"], 3),
    ("Water freezes at a temperature of", ["0 degrees Celsius", "50 degrees Celsius", "100 degrees Celsius",
                                           "200 degrees Celsius"], 0),
    ("The colour of a clear daytime sky is", ["green", "blue", "red", "black"], 1),
    ("A week has", ["five days", "six days", "seven days", "ten days"], 2),
    ("The opposite of hot is", ["warm", "bright", "loud", "cold"], 3),
    ("Two plus two equals", ["four", "five", "three", "six"], 0),
    ("The animal that barks is the", ["cat", "dog", "fish", "bird"], 1),
    ("The chemical symbol for gold is", ["Ag", "Fe", "Au", "Cu"], 2),
    ("The author of Romeo and Juliet is", ["Charles Dickens", "Jane Austen", "Mark Twain", "William Shakespeare"], 3),
    ("The first man on the Moon was", ["Neil Armstrong", "Yuri Gagarin", "Buzz Aldrin", "John Glenn"], 0),
    ("The longest river in Africa is the", ["Congo", "Nile", "Niger", "Zambezi"], 1),
    ("Bees make", ["milk", "silk", "honey", "wool"], 2),
    ("The fastest land animal is the", ["horse", "lion", "antelope", "cheetah"], 3),
]
TASK_YAML = """task: chainswarm_facts
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


def ensure_lm_eval(venv: Path) -> Path:
    """The ``lm_eval`` command of a throwaway environment (built with uv on first use)."""
    command = venv / "bin" / "lm_eval"
    if not command.exists():
        uv = Path(sys.executable).with_name("uv")
        subprocess.run([str(uv), "venv", "-q", str(venv), "-p", "3.11"], check=True)
        subprocess.run([str(uv), "pip", "install", "-q", LM_EVAL, "transformers"], check=True,
                       env={**os.environ, "VIRTUAL_ENV": str(venv)})
    return command


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's request tokenization (``TemplateAPI._encode_pair``): the context's trailing spaces move to the
    continuation, the whole is encoded at once and split where the context's own tokens end."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids):]


def reference(model_dir: str, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """Each (context, continuation)'s log-likelihood and whether it is the greedy continuation, in local
    transformers (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for context, continuation in requests:
            context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
            ids = torch.tensor([context_ids + continuation_ids])
            logp = torch.log_softmax(model(ids).logits[0, len(context_ids) - 1:-1].float(), -1)
            chosen = logp.gather(1, torch.tensor(continuation_ids)[:, None])[:, 0]
            out.append((float(chosen.sum()), bool((logp.argmax(-1) == torch.tensor(continuation_ids)).all())))
    return out


def run(model_dir: str, venv: Path, concurrency: int, batch_size: int = 1) -> dict:
    lm_eval = ensure_lm_eval(venv)
    with tempfile.TemporaryDirectory(prefix="chainswarm-lm-eval-") as work:  # the task, its data and lm-eval's output
        return _run(model_dir, lm_eval, Path(work), concurrency, batch_size)


def _run(model_dir: str, lm_eval: Path, work: Path, concurrency: int, batch_size: int) -> dict:
    from server.local_swarm import LocalSwarm

    data = work / "facts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (work / "tasks").mkdir()
    (work / "tasks" / "chainswarm_facts.yaml").write_text(TASK_YAML.format(data=data))
    with LocalSwarm(model_dir) as swarm:
        swarm.add_orchestrator(torch_dtype=DTYPE)  # every planning, admission and decoding option at its default
        nodes = [swarm.add_node(node_id=f"h{i}", memory_gb=NODE_GB, wait=False, torch_dtype=DTYPE) for i in range(2)]
        for node in nodes:
            swarm.wait_profiled(node, timeout=300)
        status = swarm.wait_chains_ready(timeout=300)
        url = swarm.orchestrator.info["url"]
        started = time.monotonic()
        command = [str(lm_eval), "--model", "local-completions", "--tasks", "chainswarm_facts",
                   "--include_path", str(work / "tasks"), "--output_path", str(work / "out"), "--log_samples",
                   "--model_args", f"model={Path(model_dir).name},base_url={url}/v1/completions,"
                   f"tokenizer={model_dir},tokenized_requests=True,num_concurrent={concurrency},max_retries=1",
                   "--batch_size", str(batch_size)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "OPENAI_API_KEY": "EMPTY", "HF_DATASETS_OFFLINE": "1"})
        wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    samples = [json.loads(line) for path in sorted((work / "out").rglob("samples_chainswarm_facts_*.jsonl"))
               for line in path.read_text().splitlines()]
    # each sample: its requests' (context, continuation) (lm-eval 0.4 logs them as {"gen_args_i": {"arg_0", "arg_1"}})
    # and their responses [[loglikelihood, is_greedy]] (as strings), in the same order
    swarm_rows = []
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        arguments = sample["arguments"]
        arguments = [(a["arg_0"], a["arg_1"]) for a in arguments.values()] if isinstance(arguments, dict) else arguments
        for (context, continuation), resp in zip(arguments, sample["resps"]):
            swarm_rows.append(((context, continuation), (float(resp[0][0]), str(resp[0][1]) == "True")))
    local = reference(model_dir, [args for args, _ in swarm_rows])
    diffs = [abs(resp[0] - ll) for (_, resp), (ll, _) in zip(swarm_rows, local)]
    greedy_same = sum(resp[1] == greedy for (_, resp), (_, greedy) in zip(swarm_rows, local))
    choices = len(QUESTIONS[0][1])
    local_acc = sum(max(range(choices), key=lambda j: local[i * choices + j][0]) == QUESTIONS[i][2]
                    for i in range(len(QUESTIONS))) / len(QUESTIONS)
    reported = next(iter(json.loads(next((work / "out").rglob("results_*.json")).read_text())["results"].values()))
    command = "python -m experiments.bench.lm_eval_check" + (f" --batch-size {batch_size}" if batch_size != 1 else "")
    return {"command": command, "lm_eval": LM_EVAL, "model": Path(model_dir).name,
            "dtype": DTYPE, "swarm": f"2 nodes x {NODE_GB} GB, orchestrator defaults",
            "chains": [c["servers"] for c in status["chains"]], "questions": len(QUESTIONS),
            "requests": len(swarm_rows), "num_concurrent": concurrency, "batch_size": batch_size, "wall_s": wall,
            "accuracy_through_swarm": reported.get("acc,none"), "accuracy_local_transformers": local_acc,
            "max_abs_loglikelihood_difference": max(diffs), "greedy_flags_equal": greedy_same,
            "lm_eval_stdout_tail": done.stdout[-1500:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--lm-eval-venv", default=str(Path(tempfile.gettempdir()) / "chainswarm-lm-eval"),
                        help="the throwaway environment with lm_eval (built on first use)")
    parser.add_argument("--concurrency", type=int, default=4, help="lm-eval's num_concurrent (default 4)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="lm-eval's batch_size: prompts per API request, sent as one batch (default 1)")
    parser.add_argument("--out", default=str(RESULTS / "lm_eval_check.json"))
    args = parser.parse_args(argv)
    if args.model is None:
        from swarm.model.store import DEFAULT_MODEL, ensure_model

        args.model = str(ensure_model(DEFAULT_MODEL, DTYPE))
    result = run(args.model, Path(args.lm_eval_venv), args.concurrency, args.batch_size)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "lm_eval_stdout_tail"}, indent=1))
    return 0 if result["max_abs_loglikelihood_difference"] < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
