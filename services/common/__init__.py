"""What every service shares: errors, telemetry, the NATS event bus, the gRPC
server bootstrap, processes and ports."""
