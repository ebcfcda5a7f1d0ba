"""The generation side: samples, data, engines' HTTP client, rollout manager.

User code written for slime ports by changing its imports to
``from rollout import GenerateState, post, Sample``.
"""

from rollout.generate import GenerateState
from rollout.http import post
from rollout.sample import RolloutBatch, Sample

__all__ = ["GenerateState", "post", "Sample", "RolloutBatch"]
