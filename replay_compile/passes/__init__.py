"""Graph passes: find each SSM state update in a Dynamo FX graph and rewrite it into ReplaySSM ops."""

from .replay_pass import PassResult, ReplaySSMPass, Rewrite, Site, Skip

__all__ = ["PassResult", "ReplaySSMPass", "Rewrite", "Site", "Skip"]
