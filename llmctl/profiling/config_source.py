"""Finding a model's config.json for `profile estimate`: a folder, a file, or a hub id (only
config.json is fetched, and only when the hub answers within seconds).

Owns: `find_config` and the hub lookup behind it.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmctl.errors import ModelLoadError
from llmctl.models.config import ModelConfig


def find_config(target: str) -> tuple[ModelConfig, str]:
    """Read a config from a folder (its config.json), a .json file, or a hub id (downloads only
    config.json).

    Returns (config, where it came from). Offline hub ids fail with one line.
    """
    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json")
        return ModelConfig.from_file(path / "config.json"), str(path / "config.json")
    if path.is_file():
        return ModelConfig.from_file(path), str(path)
    if target.endswith(".json") or target.count("/") != 1 or target.startswith((".", "/", "~")):
        raise ModelLoadError(f"{target}: no such file or folder")
    local = _hub_config(target)
    return ModelConfig.from_dict(json.loads(Path(local).read_text())), f"hf://{target}"


def _hub_config(repo_id: str) -> str:
    """Path of the hub repo's config.json: from the local hub cache, else downloaded when the hub
    answers."""
    import logging
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id=repo_id, filename="config.json", local_files_only=True)
    except Exception:  # not cached: try the network below
        pass
    host = (
        urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
        or "huggingface.co"
    )
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if not offline:
        try:  # fail in seconds, not after the hub client's retries
            socket.create_connection((host, 443), timeout=3).close()
        except OSError:
            offline = True
    if offline:
        raise ModelLoadError(
            f"hub id {repo_id!r} is not in the local cache and {host} is unreachable (offline); "
            "pass a local folder or config.json instead"
        )
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        return hf_hub_download(repo_id=repo_id, filename="config.json")
    except Exception as e:  # unknown or gated repo: one line
        raise ModelLoadError(
            f"cannot fetch config.json of hub id {repo_id!r} ({type(e).__name__}); "
            "pass a local folder or config.json instead"
        ) from None
    finally:
        hub_logger.setLevel(level)
