"""Models on the Hugging Face Hub: read as sources (``Qwen/Qwen3-8B``, ``hf://Qwen/Qwen3-8B@<revision>``) and
exports pushed to it.

A source is a hub repo when it is ``hf://ORG/NAME[@REVISION]``, or ``ORG/NAME`` that is not a local path (a local
folder always wins). It is resolved with ``huggingface_hub.snapshot_download`` into huggingface_hub's own cache
(``$HF_HOME/hub``), fetching only the files a model export needs; files already cached are not fetched again, and
``HF_HUB_OFFLINE=1`` reads the cache alone. huggingface_hub is imported only when a hub repo is used.
"""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dcptool.errors import DcptoolError, UsageError, option
from dcptool.options import HubPush

SCHEME = "hf://"
# What dcptool reads of a model repo: its weights, their index, and what an export copies beside them.
NEEDED_FILES = [
    "*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja",
]
# Only the repo's top level: subfolders hold other variants (original/, onnx/, gguf/) dcptool would not read.
SKIPPED_FILES = ["*/*"]
# The hub's repo names: ORG/NAME of letters, digits, '-', '_' and '.', not starting with '-' or '.'.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9_][\w.-]{0,95}")


class HubError(DcptoolError):
    """The hub refused a request or could not be reached (exit 2)."""


@dataclass(frozen=True)
class HubRepo:
    """A model repo on the hub, at ``revision`` (a branch, tag or commit; None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse(source: str | Path | None) -> HubRepo | None:
    """The hub repo ``source`` names, or None for a local path, a URL or anything else.

    >>> parse("hf://Qwen/Qwen3-8B@main")
    HubRepo(repo_id='Qwen/Qwen3-8B', revision='main')
    >>> parse("Qwen/Qwen3-8B"), parse("/data/step-100"), parse("step-100")
    (HubRepo(repo_id='Qwen/Qwen3-8B', revision=None), None, None)
    """
    if not isinstance(source, str):  # a Path is always a local path
        return None
    if source.startswith(SCHEME):
        repo_id, _, revision = source[len(SCHEME):].partition("@")
        if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or "@" in revision:
            raise UsageError(f"{source}: not a hub repo; write hf://ORG/NAME or hf://ORG/NAME@REVISION")
        return HubRepo(repo_id, revision or None)
    if _REPO_ID.fullmatch(source) and ".." not in source and not os.path.lexists(source):
        return HubRepo(source)
    return None


def with_revision(*sources: str | None, revision: str | None) -> list[str | None]:
    """``sources`` with ``--revision`` applied to each that is a hub repo (as ``hf://ORG/NAME@REVISION``).

    A revision given when no source is a hub repo, or given twice, is a usage error.

    >>> with_revision("step-100", "Qwen/Qwen3-8B", revision="v1.0")
    ['step-100', 'hf://Qwen/Qwen3-8B@v1.0']
    """
    if revision is None:
        return list(sources)
    repos = [parse(source) for source in sources]
    if not any(repos):
        raise UsageError(f"{option('revision', revision)} goes with a hub repo (ORG/NAME or hf://ORG/NAME), and "
                         f"{' and '.join(s for s in sources if s)} is not one (a local path wins over a repo id)")
    for source, repo in zip(sources, repos):
        if repo and repo.revision and repo.revision != revision:
            raise UsageError(f"{source}: a revision is given twice (@{repo.revision} and {option('revision', revision)})")
    return [f"{SCHEME}{repo.repo_id}@{revision}" if repo else source for source, repo in zip(sources, repos)]


def local_path(source: str | Path) -> str | Path:
    """Where ``source`` is on this machine: a hub repo's snapshot folder in the hub cache (downloaded when needed),
    anything else as given.

    >>> local_path("Qwen/Qwen3-8B")                                       # doctest: +SKIP
    '/home/me/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/b968826d9c46dd6066d109eabc6255188de91218'
    """
    repo = parse(source)
    return source if repo is None else download(repo)


def download(repo: HubRepo) -> str:
    """The snapshot folder of ``repo`` in the hub cache with the files dcptool needs, downloaded when not cached.

    huggingface_hub shows its progress bars (``HF_HUB_DISABLE_PROGRESS_BARS=1`` hides them) and reads the cache
    alone under ``HF_HUB_OFFLINE=1``; each failure becomes one line saying what to do.
    """
    from huggingface_hub import constants, errors, snapshot_download

    offline = constants.HF_HUB_OFFLINE
    get = f"`hf download {repo.repo_id}" + (f" --revision {repo.revision}`" if repo.revision else "`")
    try:
        with _progress_bars():
            folder = snapshot_download(repo.repo_id, revision=repo.revision, allow_patterns=NEEDED_FILES,
                                       ignore_patterns=SKIPPED_FILES)
    except errors.GatedRepoError:
        raise HubError(f"{repo}: a gated repo: accept its terms on {_web_url(repo.repo_id)} and log in "
                       f"(`hf auth login` or HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"{repo}: no such local file or folder, and no model repo of that name on the hub "
                       f"(a private one needs `hf auth login` or HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{repo.repo_id}: the hub has no revision {repo.revision!r} (a branch, tag or commit)") from None
    except getattr(errors, "IncompleteSnapshotError", ()):  # huggingface_hub >= 1.x tells an incomplete snapshot
        raise HubError(f"{repo}: the local hub cache holds only part of this model"
                       + (" and HF_HUB_OFFLINE=1: run without it, or " if offline else ": run ") + get) from None
    except errors.LocalEntryNotFoundError as exc:
        if offline:
            raise HubError(f"{repo}: no such local file or folder, and not in the local hub cache with "
                           f"HF_HUB_OFFLINE=1: run without it, or {get} first") from None
        raise HubError(f"{repo}: no such local file or folder, and the hub could not be reached to fetch it "
                       f"({_reason(exc.__cause__ or exc)}); check the network or HF_ENDPOINT") from None
    except errors.HfHubHTTPError as exc:
        raise HubError(f"{repo}: the hub refused the download ({_reason(exc)})") from None
    except Exception as exc:  # the connection lost mid-download, a cache folder that cannot be written
        if not _network_error(exc):
            raise
        raise HubError(f"{repo}: downloading into the hub cache failed ({_reason(exc)})") from None
    if not any(name.endswith(".safetensors") for name in os.listdir(folder)):
        raise HubError(f"{repo}: the hub repo has no .safetensors weights at its top level "
                       f"(dcptool reads a hub model's safetensors)")
    return folder


def push(folder: Path, target: HubPush) -> str:
    """Upload the export ``folder`` to the model repo ``target.repo`` and return the URL of what was uploaded.

    The repo is created when missing (private with ``target.private``; an existing repo keeps its visibility), and
    the branch ``target.branch`` too, from the default branch, so each training step can go to a branch of its own.

    >>> push(Path("hf-step-1000"), HubPush("my-org/run-7", private=True, branch="step-1000"))   # doctest: +SKIP
    'https://huggingface.co/my-org/run-7/tree/step-1000'
    """
    from huggingface_hub import HfApi, constants, errors

    repo_id, branch = target.repo, target.branch
    check_repo_id(repo_id)
    api = HfApi()
    try:
        # None rather than False: without --private a new repo gets the organization's default visibility.
        api.create_repo(repo_id, private=target.private or None, exist_ok=True)
        if branch:
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        # upload_folder, not a per-file loop: in huggingface_hub >= 1.x it is the resumable large-folder pipeline
        # (xet deduplication, a batch of commits only for very large folders), it takes a branch (revision) and a
        # commit message, and it writes nothing into the export folder, which stays as verify and checksum saw it.
        with _progress_bars():
            commit = api.upload_folder(repo_id=repo_id, folder_path=folder, revision=branch,
                                       commit_message=target.commit_message or f"Upload {folder.name} with dcptool")
    except errors.OfflineModeIsEnabled:
        raise HubError(f"{repo_id}: HF_HUB_OFFLINE is set: unset it to push; the export stays in {folder}") from None
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        hint = {401: "the token is not valid: log in again with `hf auth login`",
                403: "the token may not write to it: use a token with write access"}.get(status, _reason(exc))
        raise HubError(f"{repo_id}: the hub refused the upload ({hint}); the export stays in {folder}") from None
    except Exception as exc:
        if not _network_error(exc):
            raise
        raise HubError(f"{repo_id}: the hub at {constants.ENDPOINT} could not be reached ({_reason(exc)}); "
                       f"the export stays in {folder}") from None
    return f"{_web_url(repo_id)}/tree/{branch}" if branch else commit.commit_url


def check_repo_id(repo_id: str) -> None:
    """Refuse a --push-to-hub name that the hub cannot hold, before any work is done."""
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id:
        raise UsageError(f"{option('push_to_hub', repo_id)}: give the repo as ORG/NAME (letters, digits, '-', '_', '.')")


def check_can_push() -> None:
    """Refuse a push that cannot start (no Hugging Face token, or offline) before the export, saying what to do."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise UsageError(f"{option('push_to_hub')} needs the network, and HF_HUB_OFFLINE=1 is set: unset it")
    if get_token() is None:
        raise UsageError(f"{option('push_to_hub')}: no Hugging Face token: log in with `hf auth login` or set HF_TOKEN")


@contextmanager
def _progress_bars():
    """huggingface_hub's progress bars as ``HF_HUB_DISABLE_PROGRESS_BARS`` says now (huggingface_hub reads it once,
    when imported, which may be before the command line set it for --quiet), drawn on the stream under dcptool's
    command-line wrapper of stderr: the wrapper escapes control characters, so that names read from files cannot
    forge output, and would print the bars' carriage returns as text; the bars show no names from files."""
    from huggingface_hub.utils import disable_progress_bars

    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").lower() in ("1", "true", "yes", "on"):
        disable_progress_bars()
    wrapped = sys.stderr
    sys.stderr = getattr(wrapped, "stream", wrapped)
    try:
        yield
    finally:
        sys.stderr = wrapped


def _web_url(repo_id: str) -> str:
    from huggingface_hub import constants

    return f"{constants.ENDPOINT}/{repo_id}"


def _network_error(exc: Exception) -> bool:
    """Whether ``exc`` is a failure of the connection or the disk: OSError, or a transport error of the HTTP
    library huggingface_hub uses (requests before 1.0, httpx or httpx2 after; theirs are not OSError)."""
    return isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests")


def _reason(exc: BaseException) -> str:
    """An exception as a short single line (huggingface_hub's messages run over several lines)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."
