"""Build hook: ship ``resilient_callbacks_ds_guard.pth`` next to the package in site-packages.

Everything else is in pyproject.toml. The .pth runs ``import resilient_callbacks_ds_guard`` at
interpreter start-up (a few microseconds, stdlib only); see that module for why.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "resilient_callbacks_ds_guard.pth"


class BuildPyWithGuard(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("src", PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithGuard})
