"""``/api/v1/tokens``: API token management, admin only (``required_role``)."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Request, Response, status
from fastapi import Path as PathParam

from controller.api.deps import RuntimeDep
from controller.api.presenters import token_public
from controller.api.schemas import TokenCreate, TokenCreated, TokenPublic
from controller.errors import NotFoundError
from controller.security.tokens import TOKENS_PATH, Principal, Role

log = logging.getLogger(__name__)

router = APIRouter(prefix=TOKENS_PATH, tags=["tokens"])


@router.post(
    "",
    response_model=TokenCreated,
    status_code=status.HTTP_201_CREATED,
    summary="Make an API token for a role; the token is in this answer only (only its sha256 is kept)",
)
def create_token(body: TokenCreate, request: Request, response: Response, rt: RuntimeDep) -> TokenCreated:
    row, token = rt.auth.create(name=body.name, role=Role(body.role))
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
    return TokenCreated(**token_public(row).model_dump(), token=token)


@router.get("", response_model=list[TokenPublic], summary="API tokens: id, name, role, prefix, use")
def list_tokens(rt: RuntimeDep) -> list[TokenPublic]:
    return [token_public(r) for r in rt.auth.list()]


@router.delete(
    "/{token_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Revoke an API token (at once; idempotent)",
)
def revoke_token(token_id: Annotated[int, PathParam(ge=1, le=2**31 - 1)], rt: RuntimeDep) -> Response:
    row = rt.auth.revoke(token_id)
    if row is None:
        raise NotFoundError(f"API token #{token_id} is not known")
    log.info("API token #%s '%s' revoked", row.id, row.name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
