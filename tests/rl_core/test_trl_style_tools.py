"""The tools of an environment in TRL's convention (rl_core.agents.trl_style) are the public functions its class
defines, named by their attribute: never a method of another object the instance holds, nor a classmethod or
staticmethod."""

from __future__ import annotations

from typing import ClassVar

from rl_core.agents import ToolCall, run_tool_call
from rl_core.agents.host import LocalEnvironments
from rl_core.agents.trl_style import trl_environment
from rl_core.tasks import Example


class Client:
    """Something an environment holds: its methods are not the environment's tools."""

    deleted: ClassVar[list[str]] = []

    def delete(self, path: str) -> str:
        """Delete a file.

        Args:
            path: the file
        """
        Client.deleted.append(path)
        return "deleted"


def _total(self, amount: int) -> str:
    """Add to the running total.

    Args:
        amount: how much to add
    """
    self.total += amount
    return str(self.total)


class Shop:
    """TRL's convention, with attributes that look like tools and are not."""

    add = _total  # a function the class defines under another name: the tool `add`

    def __init__(self):
        self.fetch = Client().delete  # another object's method, held by the instance
        self.lookup = print  # a builtin the instance holds

    def reset(self, **kwargs) -> None:
        self.total = 0

    def price(self, item: str) -> str:
        """The price of an item.

        Args:
            item: its name
        """
        return "3"

    @classmethod
    def configure(cls, setting: str) -> str:
        """Change every instance's setting.

        Args:
            setting: the new setting
        """
        return setting

    @staticmethod
    def helper(x: int) -> int:
        """A helper.

        Args:
            x: a number
        """
        return x


class Branch(Shop):
    """A subclass: the base's functions are tools, its own override wins, a classmethod over a tool is none."""

    @classmethod
    def add(cls, amount: int) -> str:
        """Add to every branch.

        Args:
            amount: how much
        """
        return "all"

    def price(self, item: str) -> str:
        """The branch's price of an item.

        Args:
            item: its name
        """
        return "4"


def _opened(factory: type):
    host = LocalEnvironments()
    (opening,) = host.open(trl_environment(factory), [("k", Example("shop", ""))])
    assert opening.error is None
    return host.live["k"], sorted(t["function"]["name"] for t in opening.tools)


def test_an_attribute_holding_another_objects_method_is_not_a_tool():
    env, names = _opened(Shop)
    assert "delete" not in names and "fetch" not in names and "lookup" not in names and "print" not in names
    table = {t.__name__: t for t in env.tools}
    answer = run_tool_call(table, ToolCall("delete", {"path": "/etc/passwd"}))
    assert answer.error and answer.content.startswith("error: there is no tool 'delete'")
    assert Client.deleted == []


def test_classmethods_and_staticmethods_are_not_tools_and_a_tool_is_named_by_its_attribute():
    env, names = _opened(Shop)
    assert names == ["add", "price"]
    table = {t.__name__: t for t in env.tools}
    assert run_tool_call(table, ToolCall("add", {"amount": 2})).content == "2"
    assert run_tool_call(table, ToolCall("add", {"amount": 3})).content == "5"  # bound to this episode's instance
    assert run_tool_call(table, ToolCall("configure", {"setting": "x"})).error
    env, names = _opened(Branch)
    assert names == ["price"]
    assert run_tool_call({t.__name__: t for t in env.tools}, ToolCall("price", {"item": "tea"})).content == "4"
