"""What naming a model by hub id costs a process: the first download, a cached repo online, a cached repo offline.

A hub on 127.0.0.1 (tests/helpers/hub_server.py) serves a 64 MiB safetensors file with its config and
tokenizer; `shardwise.recipes.hub.resolve_model` fetches it once, then resolves it again with the files
in the cache (online: the file list and the revision are asked for, nothing is downloaded) and with
HF_HUB_OFFLINE (no request at all). Run from the repository root: `python benchmarks/hub_resolve.py`.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main(size_mib: int = 64, repeats: int = 5) -> None:
    from huggingface_hub import constants

    from shardwise.recipes import hub

    from helpers.hub_server import HubServer

    root = tempfile.mkdtemp(prefix="hub-resolve-")
    with HubServer() as server:
        url = server.url
        for name, value in (
            ("HF_HUB_CACHE", os.path.join(root, "hub")),
            ("ENDPOINT", url),
            ("HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"),
        ):
            setattr(constants, name, value)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        files = {"config.json": b"{}", "model.safetensors": os.urandom(size_mib * 2**20), "tokenizer.json": b"{}"}
        server.add_repo("org/model", files)

        def timed() -> float:
            start = time.perf_counter()
            hub.resolve_model("org/model")
            return time.perf_counter() - start

        first = timed()
        online = statistics.median(timed() for _ in range(repeats))
        constants.HF_HUB_OFFLINE = True
        offline = statistics.median(timed() for _ in range(repeats))
    print(
        f"first download {size_mib} MiB from 127.0.0.1: {first * 1e3:.0f} ms; cached, online (metadata only): "
        f"median {online * 1e3:.0f} ms; cached, HF_HUB_OFFLINE=1: median {offline * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
