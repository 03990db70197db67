from pdserve.transfer._hashcopy import hash64 as hash64
from pdserve.transfer._hashcopy import hash_copy as hash_copy
