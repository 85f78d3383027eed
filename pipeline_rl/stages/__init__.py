"""The pipeline's stages: the declared graph (graph.py) and what runs its user-added stages."""
