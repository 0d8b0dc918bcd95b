"""Clients of kvarena's pools: ``kvarena.integrations.transformers`` (the ``[hf]`` extra)."""
