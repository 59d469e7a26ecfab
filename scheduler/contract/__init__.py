"""The scheduler's contract with the cells, the only part of the scheduler they import: the
config package, the cell protocol (messages and commands), the records and sampling parameters
on the wire, the state machines and the error hierarchy they refer to, and the few helpers both
sides run (failpoints, token files, the prefix hash, the registration probe, the export's
schema). The pure token-in/token-out chat logic is the gateway's (`scheduler.gateway.tito`)."""
