"""The streamed generate -> extract pipeline in one Ray Data job: separate pools or one colocated engine per replica."""
