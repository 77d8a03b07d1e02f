"""Print the planner's memory against every published peak-memory figure (``dtlab.planner.memory_record``).

    python scripts/memory_record.py
"""

from dtlab.planner.memory_record import main

if __name__ == "__main__":
    main()
