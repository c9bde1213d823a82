"""Graph mode: trace a step into the IR, optimize it, lower it to a plan the actor runtime runs."""
