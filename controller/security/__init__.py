"""Security: API tokens and roles, the artifact signing key."""
