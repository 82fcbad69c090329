"""``/api/v1/whoami``: the caller's token name and role, and the roles that role includes.

The dashboard keeps the user's token in the browser and has no other way to learn what it may do;
it shows the rollout actions only where the answer says so. The API still decides each call on its
own (``controller.api.deps.authorize``): a hidden button is a courtesy, never the guard.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from controller.security.tokens import Principal, Role

router = APIRouter(prefix="/api/v1", tags=["tokens"])


class WhoAmI(BaseModel):
    name: str = Field(description="the token's name ('admin (bootstrap)' for the bootstrap token)")
    role: Role
    allows: list[Role] = Field(
        description="every role whose calls this token may make (an operator: viewer and operator)"
    )


@router.get("/whoami", response_model=WhoAmI, summary="The calling token's name, role and what it allows")
def whoami(request: Request) -> WhoAmI:
    # Set by the app-wide guard before any route runs; a GET always needs a token, so it is there.
    principal: Principal = request.state.principal
    return WhoAmI(
        name=principal.name,
        role=principal.role,
        allows=[r for r in Role if principal.role.allows(r)],
    )
