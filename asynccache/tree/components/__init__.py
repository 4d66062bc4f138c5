"""Auxiliary tree components (sliding-window attention, Mamba) and their interface."""

from asynccache.tree.components.base import Component
from asynccache.tree.components.lru import LruQueue
from asynccache.tree.components.mamba import MambaComponent
from asynccache.tree.components.swa import SWAComponent

__all__ = [
    "Component",
    "LruQueue",
    "MambaComponent",
    "SWAComponent",
]
