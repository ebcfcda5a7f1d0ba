"""Environments: multi-turn games, math and tool use, written on envs.base.Environment."""
