"""Deployments: several engines (one per device and role) described by one deploy file, planned together, started
and supervised by `deltaserve up`, behind an existing router (vllm-router). We write no router."""
