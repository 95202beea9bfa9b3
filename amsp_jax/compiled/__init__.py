"""Reading compiled programs: HLO collectives, overlap and traffic, XLA options, GPU targets, and the
audit of a plan against its compiled step."""
