"""Desired state and its rollout: twin, deployments, label selectors, rollouts; camera pools and the
placement of their cameras."""
