"""Code that runs inside the ranks (ipyparallel engines).

:mod:`.rpc` holds every function the notebook applies on a rank; it and the modules
it imports at its top (:mod:`.bootstrap`, :mod:`.cells`, :mod:`.state`,
:mod:`.transfer`) import no MLX, so the notebook can import them. The rest runs on
ranks only: :mod:`.tracker` (collectives), :mod:`.monitor` (published state),
:mod:`.output` (the rank's output), :mod:`.progress`, :mod:`.sharding` (one table of
sharding modes), :mod:`.slices`, :mod:`.gradsync`, and :mod:`.mpi_entry` (the
engines' entry point under mpirun).
"""
