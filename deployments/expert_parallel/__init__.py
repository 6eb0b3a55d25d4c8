"""An expert-parallel engine group: one Serve replica made of N vLLM ranks on a placement group
(`expert_group.py`), with rank choice, expert-load merge and per-rank engine settings
(`expert_ranks.py`)."""
