"""Auxiliary tree components (sliding-window attention, Mamba) and their interface."""

from asynccache.tree.components.base import CompData, Component
from asynccache.tree.components.lru import LruQueue
from asynccache.tree.components.mamba import MambaComponent
from asynccache.tree.components.swa import SWAComponent

__all__ = [
    "CompData",
    "Component",
    "LruQueue",
    "MambaComponent",
    "SWAComponent",
]
