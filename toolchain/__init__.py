"""mobc's driver: recipe -> source -> capture -> export -> passes -> verify -> emit."""

__version__ = "0.1.0"
