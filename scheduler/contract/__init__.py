"""The scheduler's contract with the cells, the only part of the scheduler they import: the
config schema, the cell protocol (messages and commands), the state machines and the error
hierarchy they refer to, failpoints, the API tokens, and the pure token-in/token-out chat logic
(`tito`) that the toy task runs in-process."""
