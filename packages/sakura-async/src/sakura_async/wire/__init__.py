"""The transport between a dispatcher and its workers: message framing over a socket
(:mod:`.channel`), shared-memory segments (:mod:`.shm`) and payload encoding
(:mod:`.serialize`)."""
