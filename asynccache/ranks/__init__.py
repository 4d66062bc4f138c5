"""Rank groups (how the ranks of one instance talk) and their agreement (completions retired
at ticks every rank agrees on). Below the engine: nothing here knows the cache."""

from asynccache.ranks.agreement import Agreement, PeerCopyError
from asynccache.ranks.group import SCOPES, RankGroup, SingleRank, TorchRankGroup, free_port

__all__ = ["SCOPES", "Agreement", "PeerCopyError", "RankGroup", "SingleRank", "TorchRankGroup",
           "free_port"]
