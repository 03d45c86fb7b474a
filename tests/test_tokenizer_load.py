"""swarm.model.tokenizer.load_tokenizer against transformers' own load of the same folder.

load_tokenizer builds the tokenizer from ``tokenizer.json`` alone (transformers 4.34's check of the config's added
tokens is quadratic: Gemma 3's 6,414 take 19 s) and adds afterwards only a listed token that file lacks. Whatever
it skips, the result must be the tokenizer transformers gives: the same ids, texts, special tokens and added tokens.
Gemma 3's own tokenizer is checked against its goldens in tests/test_gemma3_real.py.
"""
from __future__ import annotations

import json
import shutil

SAMPLES = ["Hello world", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
           "<|endoftext|> after <repo_name> and <tool_call>", "  spaces\t\ttabs\n\nnewlines  ", "émoji 🚀 中文",
           "a <scratch> token and <scratch_special> here, then <scratch_after>"]


def _same(ours, theirs) -> None:
    for text in SAMPLES:
        for special in (True, False):
            ids = theirs(text, add_special_tokens=special).input_ids
            assert ours(text, add_special_tokens=special).input_ids == ids, text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.all_special_ids == theirs.all_special_ids and ours.all_special_tokens == theirs.all_special_tokens

    def fields(tokenizer):
        return {i: (t.content, t.special, t.lstrip, t.rstrip, t.normalized, t.single_word)
                for i, t in tokenizer.added_tokens_decoder.items()}

    assert fields(ours) == fields(theirs)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, len(ours)) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, len(theirs))
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)


def test_the_real_folder_loads_as_transformers_loads_it(smollm2_dir):
    from transformers import AutoTokenizer

    from swarm.model.tokenizer import load_tokenizer

    assert json.loads((smollm2_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]  # the fast path
    _same(load_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir)))


def test_an_added_token_only_the_config_lists_is_added_as_transformers_adds_it(smollm2_dir, tmp_path):
    """A folder whose tokenizer_config.json lists added tokens its tokenizer.json lacks (a slow-to-fast
    conversion can leave one): they are added, with the ids and specialness transformers gives them."""
    from transformers import AutoTokenizer

    from swarm.model.tokenizer import load_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(smollm2_dir, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    size = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"].__len__()
    for offset, (content, special) in enumerate((("<scratch>", False), ("<scratch_special>", True),
                                                 ("<scratch_after>", False))):
        config["added_tokens_decoder"][str(size + offset)] = {
            "content": content, "lstrip": False, "normalized": not special, "rstrip": False, "single_word": False,
            "special": special}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert ours.convert_tokens_to_ids(["<scratch>", "<scratch_special>", "<scratch_after>"]) == [size, size + 1,
                                                                                                 size + 2]
    _same(ours, theirs)


def decoder_cases(tokenizer, samples, seed: int = 0) -> list[list[int]]:
    """The samples' ids, random id lists over the whole vocabulary and over the added and special tokens (few and
    short: transformers' own decode takes ~10 ms per random id there)."""
    import random

    rng = random.Random(seed)
    added = sorted(tokenizer.added_tokens_decoder)
    return [tokenizer(text).input_ids for text in samples] + [
        [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))] for _ in range(6)] + [
        [rng.choice(added) if rng.random() < 0.5 else rng.randrange(len(tokenizer)) for _ in range(8)]
        for _ in range(4)]


def test_the_engines_decoder_gives_what_tokenizer_decode_gives(smollm2_dir):
    """swarm.model.tokenizer.text_decoder (the Rust decode the engine's streams and stop strings use, without
    transformers' per-id walk) against the tokenizer's own decode, special tokens skipped, with and without
    clean_up_tokenization_spaces."""
    from swarm.model.tokenizer import load_tokenizer, text_decoder

    tokenizer = load_tokenizer(smollm2_dir)
    cases = decoder_cases(tokenizer, SAMPLES)
    for clean_up in (False, True):
        tokenizer.clean_up_tokenization_spaces = clean_up
        decode = text_decoder(tokenizer)
        for ids in cases:
            assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), (clean_up, ids)
