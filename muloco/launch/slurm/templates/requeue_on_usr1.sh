trap 'requeue_self "USR1: time limit or preemption" && exit 0; exit 1' USR1
