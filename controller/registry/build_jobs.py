"""Variant builds as jobs that any controller replica may claim.

A model version whose status is ``building`` is a job; its claim lives on the row: ``build_owner``
(the replica), ``build_token`` (a random token only the claiming build knows), ``build_heartbeat_at``
(renewed while the build runs) and ``build_attempts`` (claims so far).

- **Claim.** The oldest job that nobody holds, or whose holder stopped renewing it for a lease, is
  taken in one transaction: ``SELECT … FOR UPDATE SKIP LOCKED`` on PostgreSQL (two replicas never
  pick the same row and never wait on each other), then an ``UPDATE`` that only succeeds if the
  row's token is still the one read (SQLite ignores the row lock; this compare-and-set is what keeps
  a claim single there, and it guards PostgreSQL too).
- **Fencing.** Every later write of the build (progress, renewal, the result, a release) carries
  ``WHERE build_token = <ours>``: a replica whose claim expired and was taken over writes nothing,
  so its late result never overwrites the new owner's.
- **Bound.** A claim that ends without a result (its replica died, or the build broke outside the
  builder) counts as an attempt; a job with ``max_attempts`` claims that ends that way again is
  marked failed ("build abandoned N times: …") with fp32 serving, instead of killing replica after
  replica for ever. A clean stop gives its attempt back. A builder that raises is a verdict on the
  model, not an abandoned claim: the version is failed at once (controller/registry/builder.py).

Leases are judged by each replica's clock against the holder's: replicas' clocks must agree to well
within a lease (NTP), as for ``controller_replica``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, func, select

from controller.db import crud
from controller.db.engine import session_scope
from controller.db.states import ModelVersionStatus
from controller.db.tables import ModelVariant, ModelVersion, utcnow

log = logging.getLogger(__name__)

QUEUED = "queued"


@dataclass(frozen=True)
class Claim:
    """One build's hold on one job: its writes are fenced by ``token``."""

    model_version_id: int
    token: str
    attempt: int


def fallback_rows(*, sha256: str, size: int, path: str, error: str) -> list[ModelVariant]:
    """The variants of a version whose build gave no verdict: fp32 serves, the others say why not."""
    return [
        ModelVariant(
            model_version_id=0, variant="fp32", sha256=sha256, size=size, fit=True, target="any", path=path
        )
    ] + [
        ModelVariant(variant=v, fit=False, reason=f"not built: {error}", target=t, model_version_id=0)
        for v, t in (("fp16", "gpu"), ("int8", "cpu"))
    ]


class BuildJobs:
    """The build jobs in ``model_version`` as one replica works them."""

    def __init__(
        self,
        engine: Engine,
        *,
        owner: str,
        lease_s: float,
        max_attempts: int,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        if lease_s <= 0 or max_attempts < 1:
            raise ValueError("lease_s must be > 0 and max_attempts >= 1")
        self._engine = engine
        self._owner = owner[:64]
        self._lease = timedelta(seconds=lease_s)
        self._max_attempts = max_attempts
        self._clock = clock

    @property
    def owner(self) -> str:
        return self._owner

    def _unheld(self, now: datetime) -> sa.ColumnElement[bool]:
        return sa.or_(
            col(ModelVersion.build_owner).is_(None),
            col(ModelVersion.build_heartbeat_at).is_(None),
            col(ModelVersion.build_heartbeat_at) < now - self._lease,
        )

    def claim(self) -> Claim | None:
        """Take the oldest job nobody holds (or whose holder's lease ran out); None when there is none."""
        with session_scope(self._engine) as s:
            now = self._clock()
            mv = s.exec(
                select(ModelVersion)
                .where(
                    col(ModelVersion.status) == ModelVersionStatus.BUILDING,
                    col(ModelVersion.build_attempts) < self._max_attempts,
                    self._unheld(now),
                )
                .order_by(col(ModelVersion.id))
                .limit(1)
                .with_for_update(skip_locked=True)
            ).first()
            if mv is None:
                return None
            assert mv.id is not None
            token = secrets.token_hex(16)
            taken = self._update(
                s,
                mv.id,
                col(ModelVersion.build_token).is_not_distinct_from(mv.build_token),
                col(ModelVersion.status) == ModelVersionStatus.BUILDING,
                values={
                    "build_owner": self._owner,
                    "build_token": token,
                    "build_heartbeat_at": now,
                    "build_attempts": mv.build_attempts + 1,
                },
            )
            if not taken:
                return None  # another worker of this database took it between our read and write
            if mv.build_owner is not None:
                log.warning(
                    "model version %d: the build claim of replica %s expired; replica %s takes it (attempt %d)",
                    mv.id,
                    mv.build_owner,
                    self._owner,
                    mv.build_attempts + 1,
                )
            return Claim(mv.id, token, mv.build_attempts + 1)

    def renew(self, claim: Claim, **fields: Any) -> bool:
        """Extend the lease (and write ``fields``, e.g. progress); False when the claim is no longer ours."""
        with session_scope(self._engine) as s:
            return self._update(s, claim, values={"build_heartbeat_at": self._clock(), **fields})

    def finish(self, claim: Claim, s: Session, *, sha256: str, **fields: Any) -> bool:
        """In the caller's transaction: end the claim with the build's result ``fields``, only while
        the claim is still ours and the version still has the bytes that were built. The caller
        writes the variants after True, in the same transaction."""
        return self._update(
            s,
            claim,
            col(ModelVersion.sha256) == sha256,
            values={"build_owner": None, "build_token": None, "build_heartbeat_at": None, **fields},
        )

    def release(self, claim: Claim) -> bool:
        """Give the job back unbuilt after a clean stop: the next poll of any replica takes it, and
        this attempt is not counted against the bound."""
        with session_scope(self._engine) as s:
            return self._update(
                s,
                claim,
                values={
                    "build_owner": None,
                    "build_token": None,
                    "build_heartbeat_at": None,
                    "build_attempts": max(claim.attempt - 1, 0),
                    "build_stage": QUEUED,
                    "build_progress": 0.0,
                },
            )

    def abandon(self, claim: Claim, error: str) -> bool:
        """Give the job back after a failure outside the builder: the attempt counts, and the error is
        shown meanwhile (and quoted if the bound ends the job)."""
        with session_scope(self._engine) as s:
            return self._update(
                s,
                claim,
                values={
                    "build_owner": None,
                    "build_token": None,
                    "build_heartbeat_at": None,
                    "build_stage": QUEUED,
                    "build_progress": 0.0,
                    "build_error": f"attempt {claim.attempt} ended: {error}"[:500],
                },
            )

    def give_up_abandoned(self) -> list[int]:
        """Mark failed the jobs that used up their attempts and whose last claim ended without a
        result; fp32 serves them. Returns their ids (their devices may need recomputing)."""
        done: list[int] = []
        with session_scope(self._engine) as s:
            now = self._clock()
            rows = s.exec(
                select(ModelVersion)
                .where(
                    col(ModelVersion.status) == ModelVersionStatus.BUILDING,
                    col(ModelVersion.build_attempts) >= self._max_attempts,
                    self._unheld(now),
                )
                .order_by(col(ModelVersion.id))
                .with_for_update(skip_locked=True)
            ).all()
            for mv in rows:
                assert mv.id is not None
                last = mv.build_error or (
                    f"replica {mv.build_owner} stopped renewing its claim"
                    if mv.build_owner is not None
                    else "its claim was released without a result"
                )
                error = f"build abandoned {mv.build_attempts} times: {last}"[:500]
                ended = self._update(
                    s,
                    mv.id,
                    col(ModelVersion.build_token).is_not_distinct_from(mv.build_token),
                    col(ModelVersion.status) == ModelVersionStatus.BUILDING,
                    values={
                        "status": ModelVersionStatus.FAILED,
                        "build_stage": "done",
                        "build_progress": 100.0,
                        "build_error": error,
                        "build_owner": None,
                        "build_token": None,
                        "build_heartbeat_at": None,
                    },
                )
                if not ended:
                    continue
                crud.replace_variants(
                    s,
                    model_version_id=mv.id,
                    variants=fallback_rows(sha256=mv.sha256, size=mv.size, path=mv.path, error=error),
                )
                log.error("model version %d (%s:%s): %s; fp32 serves", mv.id, mv.name, mv.version, error)
                done.append(mv.id)
        return done

    def pending(self, *, besides: int | None = None) -> int:
        """Jobs waiting or being built, across every replica (``besides``: one not to count)."""
        with Session(self._engine) as s:
            q = (
                select(func.count())
                .select_from(ModelVersion)
                .where(col(ModelVersion.status) == ModelVersionStatus.BUILDING)
            )
            if besides is not None:
                q = q.where(col(ModelVersion.id) != besides)
            return int(s.exec(q).one())

    def _update(
        self, s: Session, target: Claim | int, *conditions: sa.ColumnElement[bool], values: dict[str, Any]
    ) -> bool:
        """One ``UPDATE`` of one version, true when it changed the row: a claim's updates are fenced
        by its token."""
        if isinstance(target, Claim):
            mv_id = target.model_version_id
            conditions = (col(ModelVersion.build_token) == target.token, *conditions)
        else:
            mv_id = target
        result = s.connection().execute(
            sa.update(ModelVersion).where(col(ModelVersion.id) == mv_id, *conditions).values(**values)
        )
        return result.rowcount == 1
