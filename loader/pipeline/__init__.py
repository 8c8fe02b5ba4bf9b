"""How records become batches: native readers, the shuffle buffer, parts, one epoch's stream, memory."""
