"""Adapters (``lightning``, ``transformers``, ``accelerate``) that give a framework's training
worker_lib's guarantees: resume from a committed step, beats, one agreed stop. Each imports its
framework only when it is imported itself: ``import worker_lib`` never does.
"""
