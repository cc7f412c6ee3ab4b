"""What a trial leaves behind: the judgement of one trial against its golden run (`judgement`),
and the durable tables (`records`). `schema` is all that analysis may read of the harness."""
