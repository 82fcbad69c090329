"""The updater's downloads folder is collected: a partial package no desired state names any more goes
after its grace; the one of the version desired stays, to be resumed."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from edge_agent.update.install import PackageFetcher
from edge_agent.update.updater import AgentUpdater
from fleet_protocol.messages import AgentPackageRef, ArtifactRequest
from tests.support.waiting import wait_for

DAY = 86_400.0


def partial(store: Path, sha: str, *, age_s: float) -> list[Path]:
    store.mkdir(parents=True, exist_ok=True)
    paths = [store / f"{sha}.part", store / f"{sha}.bitmap"]
    when = time.time() - age_s
    for p in paths:
        p.write_bytes(b"x" * 100)
        os.utime(p, (when, when))
    return paths


def no_event(*args: Any, **kwargs: Any) -> None:
    return None


def test_a_partial_package_no_longer_desired_is_collected_and_the_desired_one_kept(tmp_path: Path) -> None:
    def request(req: ArtifactRequest) -> bool:
        return False  # the link is down: nothing is fetched in this test

    stop = threading.Event()
    fetcher = PackageFetcher(tmp_path, request, partial_grace_s=DAY, collect_interval_s=0.01)
    upd = AgentUpdater(
        data_dir=tmp_path,
        request=request,
        emit=no_event,
        stop=stop,
        key=None,
        require_signed=False,
        running_version="1.0",
        running_slot=None,  # unsupervised: the wanted version is refused, and never fetched
        fetcher=fetcher,
    )
    wanted = AgentPackageRef(version="1.2", sha256="b" * 64, size=100, chunk_size=1024)
    abandoned = partial(fetcher.store, "a" * 64, age_s=2 * DAY)  # of a version desired once
    resumable = partial(fetcher.store, wanted.sha256, age_s=2 * DAY)
    recent = partial(fetcher.store, "c" * 64, age_s=60.0)
    upd.want(wanted)

    thread = threading.Thread(target=upd.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: not any(p.exists() for p in abandoned), what="the abandoned partial collected")
    finally:
        stop.set()
        thread.join(5)

    assert all(p.exists() for p in resumable)
    assert all(p.exists() for p in recent), "written a minute ago: within its grace"
