from pdserve.transfer._hashcopy import hash_copy as hash_copy
