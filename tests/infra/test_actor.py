"""Every role's Ray actor answers the one actor protocol (infra/actor.py), and its constructor loads no model."""

from __future__ import annotations

import inspect

import pytest

from infra.actor import Actor
from infra.engines import RolloutWorker
from infra.policy_worker import PolicyWorker
from infra.rewards import RewardWorker
from infra.teacher import TeacherWorker


@pytest.mark.parametrize("cls", [PolicyWorker, RolloutWorker, TeacherWorker, RewardWorker])
def test_every_role_actor_answers_the_protocol(cls):
    for name in ("preload", "setup", "info", "shutdown"):
        assert inspect.isfunction(getattr(cls, name, None)), f"{cls.__name__}.{name}"
    assert issubclass(cls, Actor)
