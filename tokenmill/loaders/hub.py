"""Models named by their Hugging Face Hub id (`ORG/NAME`), fetched through
`huggingface_hub` into its cache (HF_HOME / HF_HUB_CACHE, or --download-dir):
the cached snapshot when it is there, a download of what is missing otherwise
(config, tokenizer and safetensors files only, or the one GGUF file asked
for), nothing from the network under HF_HUB_OFFLINE=1. HF_TOKEN is read by
huggingface_hub itself.

`ORG/NAME:QUANT` (vLLM's and llama.cpp's form) picks the GGUF file of a GGUF
repo whose name holds QUANT, as `--gguf-file` names one exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

from tokenmill.loaders.errors import ModelSourceError

# what a safetensors checkpoint needs to load and serve; everything else in a
# repo (other weight formats, images, ONNX exports) is left on the Hub
CHECKPOINT_FILES = [
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "chat_template.json"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*"
                     r"(:[A-Za-z0-9_.\-]+)?$")


def looks_like_hub_id(text: str) -> bool:
    """ORG/NAME (or ORG/NAME:QUANT) that is not a path on this machine."""
    return bool(_HUB_ID.match(text)) and not Path(text).expanduser().exists()


def fetch_model(repo_id: str, revision: str | None = None, download_dir: str | None = None,
                gguf_file: str | None = None) -> Path:
    """The local path of `repo_id`'s checkpoint directory (or GGUF file), from the
    cache or downloaded into it; a ModelSourceError that says which failed."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    repo_id, _, quant = repo_id.partition(":")
    if quant and gguf_file:
        raise ModelSourceError(f"give the GGUF file once: {repo_id}:{quant} or --gguf-file "
                               f"{gguf_file}, not both")
    patterns = [gguf_file] if gguf_file else [f"*{quant}*.gguf", f"*{quant.lower()}*.gguf"] \
        if quant else CHECKPOINT_FILES
    offline = constants.HF_HUB_OFFLINE
    cache = download_dir or constants.HF_HUB_CACHE
    where = f"the Hugging Face cache ({cache})"
    hub = f"the Hub at {constants.ENDPOINT}"
    try:
        path = Path(huggingface_hub.snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns))
    except errors.RepositoryNotFoundError:
        raise ModelSourceError(f"{hub} has no model {repo_id!r} (network: the repository was "
                               "not found; if it is private or gated, set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise ModelSourceError(f"{hub}: model {repo_id!r} has no revision {revision!r} "
                               "(network: revision not found)") from None
    except errors.LocalEntryNotFoundError as e:
        reason = "HF_HUB_OFFLINE=1 forbids downloading it" if offline else \
            f"and {hub} could not be reached ({_cause(e)})"
        raise ModelSourceError(f"model {repo_id!r}{_at(revision)} is not in {where}, "
                               f"{reason}") from None
    except errors.HfHubHTTPError as e:
        raise ModelSourceError(f"downloading {repo_id!r} from {hub} failed (network): "
                               f"{str(e).splitlines()[0]}") from None
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"fetching {repo_id!r} into {where} failed: {e}") from None
    return _model_in(path, repo_id, gguf_file, quant)


def _model_in(path: Path, repo_id: str, gguf_file: str | None, quant: str) -> Path:
    if gguf_file or quant:
        ggufs = sorted(path.rglob("*.gguf"))
        wanted = [g for g in ggufs if (g.name == Path(gguf_file).name if gguf_file
                                       else quant.lower() in g.name.lower())]
        if not wanted:
            what = f"the file {gguf_file!r}" if gguf_file else f"a GGUF file matching {quant!r}"
            raise ModelSourceError(f"model {repo_id!r} has no {what}")
        if len(wanted) > 1:  # a split GGUF: its first part names the rest
            first = [g for g in wanted if "-00001-of-" in g.name]
            if not first:
                raise ModelSourceError(f"{quant!r} matches several GGUF files of {repo_id!r} "
                                       f"({', '.join(g.name for g in wanted)}); name one with "
                                       "--gguf-file")
            wanted = first
        return wanted[0]
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        hint = "; a GGUF repo: pass --gguf-file NAME or ORG/NAME:QUANT" \
            if any(path.glob("*.gguf")) or "gguf" in repo_id.lower() else ""
        raise ModelSourceError(f"model {repo_id!r} ({path}) has no config.json and "
                               f"*.safetensors weights{hint}")
    return path


def _at(revision: str | None) -> str:
    return f" (revision {revision})" if revision else ""


def _cause(error: BaseException) -> str:
    cause = error.__cause__ or error.__context__ or error
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
