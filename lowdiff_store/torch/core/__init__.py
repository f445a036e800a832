"""What a torch log holds, shared by every other room: tensor names and the state digest
(:mod:`.schema`), typed msgpack for non-tensor state, tensors as bit patterns, optimizer
wrapping, the records DDP communication hooks leave (:mod:`.hook_records`), the encoded-tensor
specs handed to the writer, and the split of tensors between ranks. Imports no sibling room."""
