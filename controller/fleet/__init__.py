"""Desired state and its rollout: twin, deployments, label selectors, rollouts."""
