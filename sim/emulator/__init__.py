"""Emulated SGLang workers: the simulator's cache and service model behind SGLang's HTTP API."""

from sim.emulator.app import create_emulator_app
from sim.emulator.server import EmulatorConfig

__all__ = ["EmulatorConfig", "create_emulator_app"]
