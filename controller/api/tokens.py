"""``/api/v1/tokens``: API token management, admin only (``required_role``)."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi import Path as PathParam

from controller.api.deps import runtime
from controller.api.schemas import TokenCreate, TokenCreated, TokenPublic
from controller.db.tables import ApiToken
from controller.security.tokens import TOKENS_PATH, Principal, Role, TokenAuthority

log = logging.getLogger(__name__)


def _public(row: ApiToken) -> TokenPublic:
    assert row.id is not None
    return TokenPublic(
        id=row.id,
        name=row.name,
        role=Role(row.role).value,
        prefix=row.prefix,
        created_at=row.created_at,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )


router = APIRouter(prefix=TOKENS_PATH, tags=["tokens"])


def authority(request: Request) -> TokenAuthority:
    return runtime(request).auth


@router.post(
    "",
    response_model=TokenCreated,
    status_code=status.HTTP_201_CREATED,
    summary="Make an API token for a role; the token is in this answer only (only its sha256 is kept)",
)
def create_token(body: TokenCreate, request: Request, response: Response) -> TokenCreated:
    row, token = authority(request).create(name=body.name, role=Role(body.role))
    by: Principal | None = getattr(request.state, "principal", None)
    log.info(
        "API token #%s '%s' (%s, %s…) made by '%s'",
        row.id,
        row.name,
        row.role,
        row.prefix,
        by.name if by else "?",
    )
    response.headers["Cache-Control"] = "no-store"
    return TokenCreated(**_public(row).model_dump(), token=token)


@router.get("", response_model=list[TokenPublic], summary="API tokens: id, name, role, prefix, use")
def list_tokens(request: Request) -> list[TokenPublic]:
    return [_public(r) for r in authority(request).list()]


@router.delete(
    "/{token_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Revoke an API token (at once; idempotent)",
)
def revoke_token(token_id: Annotated[int, PathParam(ge=1, le=2**31 - 1)], request: Request) -> Response:
    row = authority(request).revoke(token_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"API token #{token_id} is not known")
    log.info("API token #%s '%s' revoked", row.id, row.name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
