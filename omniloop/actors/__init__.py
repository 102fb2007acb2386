"""Actors: the stage loop, the frontend Engine, the supervisor and the thread-safe doorway."""
