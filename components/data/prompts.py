"""Synthetic prompts for self-distillation training of Medusa heads.

`training_prompts(n, seed)` returns n distinct chat prompts built from ~100 instruction templates
(explanations, stories, poems, emails, lists, comparisons, how-to steps, Python coding tasks,
arithmetic word problems with random numbers, definitions, advice, rewrite/repeat tasks, trivia,
...) filled from a few hundred topics and objects. Pure Python, no downloads. The pool itself is
fixed; `seed` only decides the order, which interleaves the templates so any prefix is varied.
Prompts identical to the held-out evaluation prompts in pipeline/prompts/*.jsonl are removed.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
_HELD_OUT_DIR = _REPO_ROOT / "pipeline" / "prompts"
_HELD_OUT_FILES = ("bench.jsonl", "repeat.jsonl", "novel.jsonl")
_POOL_SEED = 1234  # fixes the random numbers/samples inside the pool (not the order)

# --------------------------------------------------------------------------------------------
# Fillers
# --------------------------------------------------------------------------------------------

TOPICS: dict[str, list[str]] = {
    "science": [
        "photosynthesis", "the water cycle", "black holes", "gravity", "the theory of evolution",
        "DNA", "the periodic table", "plate tectonics", "volcanoes", "earthquakes",
        "the greenhouse effect", "electricity", "magnetism", "the speed of light", "atoms",
        "chemical reactions", "the immune system", "vaccines", "the solar system", "the Big Bang",
        "climate change", "ocean tides", "sound waves", "rainbows", "static electricity",
        "friction", "the human brain", "the digestive system", "cells", "bacteria", "viruses",
        "renewable energy", "nuclear fusion", "the phases of the Moon", "comets", "the ozone layer",
        "fossils", "the states of matter", "microscopes",
    ],
    "history": [
        "the Roman Empire", "ancient Egypt", "the pyramids of Giza", "the Great Wall of China",
        "the Renaissance", "the Industrial Revolution", "the French Revolution",
        "the American Revolution", "the printing press", "the Silk Road", "the Vikings",
        "the Middle Ages", "the Cold War", "the Apollo moon landing", "the fall of the Berlin Wall",
        "ancient Greece", "the ancient Olympic Games", "the Aztec Empire", "the Inca Empire",
        "the Ottoman Empire", "the invention of the telephone", "the history of writing",
        "the Stone Age", "the Bronze Age", "medieval castles", "the samurai of Japan",
        "the Age of Exploration", "the Magna Carta", "the history of the bicycle",
        "the history of money", "the first transcontinental railroad", "the Mongol Empire",
        "the history of chess", "the first airplanes", "the history of the internet",
        "the Maya civilization", "the Byzantine Empire", "the Gold Rush",
    ],
    "cooking": [
        "sourdough bread", "homemade pizza", "tomato pasta sauce", "fried rice", "pancakes",
        "chocolate chip cookies", "vegetable soup", "grilled cheese sandwiches", "omelettes",
        "curry", "sushi", "tacos", "baking with yeast", "fermentation in cooking", "knife skills",
        "roasting vegetables", "Indian spices", "Italian cooking", "French pastry", "meal prepping",
        "salad dressings", "barbecue", "stir-frying", "fruit smoothies", "herbal tea",
        "making jam", "kitchen safety", "cast iron pans", "food storage", "vegan cooking",
        "quick breakfast recipes", "baking birthday cakes", "homemade hummus", "dumplings",
        "homemade lemonade", "cooking rice", "the Maillard reaction", "olive oil",
    ],
    "sports": [
        "soccer", "basketball", "tennis", "swimming", "marathon running", "cycling",
        "the modern Olympic Games", "baseball", "cricket", "volleyball", "rock climbing", "yoga",
        "skiing", "surfing", "martial arts", "table tennis", "golf", "rugby", "ice hockey",
        "gymnastics", "badminton", "boxing", "skateboarding", "the offside rule in soccer",
        "stretching before exercise", "team sports", "the Tour de France", "the World Cup",
        "sprinting", "hiking", "rowing", "archery", "fencing", "triathlons", "sports nutrition",
        "figure skating", "water polo", "sailing",
    ],
    "programming": [
        "variables in Python", "Python lists", "Python dictionaries", "for loops", "while loops",
        "recursion", "functions in Python", "object-oriented programming", "classes in Python",
        "exceptions in Python", "list comprehensions", "sorting algorithms", "binary search",
        "hash tables", "linked lists", "stacks and queues", "version control with Git",
        "unit testing", "debugging", "web APIs", "the JSON format", "regular expressions",
        "SQL databases", "HTML", "CSS", "JavaScript", "the command line", "big O notation",
        "string formatting in Python", "reading files in Python", "Python modules",
        "virtual environments", "type hints in Python", "lambda functions",
        "generators in Python", "code comments", "clean code", "binary numbers",
        "open source software", "machine learning",
    ],
    "travel": [
        "visiting Paris", "traveling by train", "backpacking in Europe", "packing for a long trip",
        "visiting Japan", "road trips", "camping in national parks", "travel insurance", "jet lag",
        "learning phrases before a trip", "traveling on a budget", "visiting museums",
        "beach vacations", "mountain hiking trips", "cruise ships", "traveling with children",
        "staying in hostels", "airport security", "the city of Rome", "New York City", "Iceland",
        "the Grand Canyon", "Venice", "the Amazon rainforest", "safaris in Kenya",
        "street food markets", "traveling alone", "visiting Egypt", "Machu Picchu",
        "the Swiss Alps", "island hopping in Greece", "renting a car abroad",
        "local customs when traveling", "buying souvenirs", "travel photography", "time zones",
        "passports and visas", "long-haul flights",
    ],
    "health": [
        "healthy sleep", "drinking enough water", "regular exercise", "a balanced diet",
        "vitamins", "stress management", "meditation", "good posture", "dental hygiene",
        "washing hands", "sun protection", "healthy breakfasts", "the benefits of walking",
        "mental health", "heart health", "reducing sugar", "reading food labels", "first aid",
        "screen time", "healthy snacks", "fiber in food", "protein", "caffeine",
        "seasonal allergies", "the common cold", "staying active at a desk job",
        "breathing exercises", "mindfulness", "eye health", "hearing protection",
        "strength training", "healthy aging", "hydration during sports", "the seasonal flu",
        "hand stretches for typists", "healthy lunch ideas", "walking meetings",
    ],
    "everyday": [
        "keeping a tidy home", "budgeting money", "grocery shopping", "doing laundry",
        "time management", "making friends", "writing a to-do list", "recycling", "gardening",
        "houseplants", "caring for a dog", "caring for a cat", "saving energy at home",
        "morning routines", "cooking for one", "decluttering", "commuting to work",
        "moving to a new home", "simple home repairs", "public libraries",
        "writing thank-you notes", "planning a birthday party", "learning a new language",
        "reading books", "keeping a journal", "board games", "phone etiquette",
        "online shopping", "being a good neighbor", "organizing a closet",
        "hosting dinner guests", "saving for a vacation", "using public transport",
        "cleaning the kitchen", "planning meals for the week", "choosing a gift",
        "composting", "bicycle maintenance",
    ],
    "business": [
        "starting a small business", "marketing", "customer service", "writing a resume",
        "job interviews", "leadership", "teamwork", "negotiation", "public speaking",
        "project management", "supply and demand", "inflation", "interest rates",
        "the stock market", "company budgets", "running effective meetings", "remote work",
        "professional networking", "branding", "e-commerce", "basic accounting",
        "business plans", "startups", "entrepreneurship", "product design", "sales techniques",
        "email etiquette at work", "giving feedback", "workplace culture", "small business loans",
        "pricing a product", "social media marketing", "competition between companies",
        "franchising", "international trade", "customer loyalty programs", "cash flow",
        "hiring a first employee",
    ],
    "nature": [
        "rainforests", "deserts", "coral reefs", "the Arctic", "rivers", "mountains", "wetlands",
        "bees", "butterflies", "whales", "wolves", "owls", "elephants", "dolphins", "penguins",
        "trees", "mushrooms", "wildflowers", "migratory birds", "the four seasons",
        "thunderstorms", "hurricanes", "snow", "the night sky", "national parks",
        "endangered species", "food chains", "ocean currents", "caves", "waterfalls", "lakes",
        "grasslands", "octopuses", "ants", "frogs", "sharks", "tortoises", "bamboo forests",
        "cacti", "volcanic islands",
    ],
}

GENERIC_TOPIC_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "Tell me three interesting facts about {t}.",
    "Describe {t} to a ten-year-old.",
    "Summarize the key ideas of {t} in three bullet points.",
    "What are common misconceptions about {t}?",
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "Write a quiz with three questions about {t}.",
    "Give me a beginner's introduction to {t}.",
    "Why should people learn about {t}?",
    "Write the opening paragraph of a blog post about {t}.",
    "What are some good questions to ask about {t}?",
    "Explain {t} in one paragraph, then give an example.",
    "Write a limerick about {t}.",
    "Create a simple lesson plan for teaching {t}.",
    "Write a tweet-length summary of {t}.",
]

DOMAIN_TEMPLATES: dict[str, list[str]] = {
    "science": ["How would a scientist explain {t}?", "How was {t} first discovered or understood?"],
    "history": ["Describe daily life in the time of {t}.", "What can we learn today from {t}?",
                "Tell me about {t} as if you were a tour guide."],
    "cooking": ["What are some tips for beginners interested in {t}?",
                "What common mistakes do people make with {t}?"],
    "sports": ["How can a beginner get started with {t}?", "What are the health benefits of {t}?"],
    "programming": ["Explain {t} with a short Python example.",
                    "What are common beginner mistakes with {t}?"],
    "travel": ["What should I know about {t}?", "Give me some travel tips related to {t}."],
    "health": ["Give me practical advice about {t}.", "What does research say about {t}?"],
    "everyday": ["Give me practical advice about {t}.",
                 "What are common mistakes people make with {t}?"],
    "business": ["Explain {t} to someone starting their first job.",
                 "Give me practical advice about {t}."],
    "nature": ["Describe {t} as a nature documentary narrator would.",
               "How does climate change affect {t}?"],
}

LIST_CATEGORIES = [
    "fruits that are rich in vitamins", "vegetables that grow well in a home garden",
    "animals that live in the ocean", "birds that cannot fly", "countries in South America",
    "famous scientists", "inventions that changed the world", "board games for families",
    "hobbies you can do at home", "ways to reduce stress", "healthy breakfast foods",
    "things to pack for a beach trip", "uses of a smartphone", "careers in healthcare",
    "musical instruments", "popular programming languages", "ways to save money on groceries",
    "indoor plants that are easy to care for", "sports played with a ball",
    "books every teenager should read", "kitchen tools every cook needs", "types of clouds",
    "renewable sources of energy", "ways to be more productive", "things to do on a rainy day",
    "questions to ask in a job interview", "benefits of reading", "tips for learning a language",
    "mammals that live in cold climates", "ingredients for a simple salad",
    "ways to stay safe online", "common Python data types", "famous landmarks in Europe",
    "activities for a family weekend", "foods that contain protein", "reasons to exercise",
    "ways to make a small room look bigger", "things to check before a long drive",
    "good habits for students", "snacks for a long hike", "types of renewable materials",
    "ways to help the environment", "colors of the rainbow", "simple science experiments for kids",
    "spices used in Indian cooking", "exercises you can do without equipment",
    "features of a good website", "skills every manager needs", "ways to improve sleep",
    "gift ideas for a coworker", "things to see in Paris", "desert animals",
    "ways to practice gratitude", "items for a first aid kit", "common mistakes in writing",
    "fun facts about the Moon", "ways to reuse glass jars", "topics for a short speech",
    "breakfast ideas without eggs", "household chores kids can help with",
]
LIST_TEMPLATES = ["List {n} {c}.", "Name {n} {c}.", "Give me a list of {n} {c}, with one sentence about each."]

COMPARE_ITEMS: dict[str, list[str]] = {
    "animals": ["lions", "tigers", "wolves", "foxes", "dolphins", "sharks", "eagles", "owls",
                "horses", "donkeys", "frogs", "toads", "bees", "wasps"],
    "fruits": ["apples", "oranges", "bananas", "mangoes", "grapes", "strawberries", "pears",
               "pineapples", "blueberries", "watermelons"],
    "sports": ["soccer", "basketball", "tennis", "badminton", "swimming", "running", "cycling",
               "baseball", "cricket", "rugby"],
    "languages": ["Python", "JavaScript", "Java", "C", "Rust", "Go", "Ruby", "SQL"],
    "python": ["lists", "tuples", "sets", "dictionaries", "for loops", "while loops",
               "functions", "classes", "generators"],
    "drinks": ["tea", "coffee", "orange juice", "milk", "water", "hot chocolate", "lemonade"],
    "vehicles": ["cars", "bicycles", "trains", "buses", "airplanes", "motorcycles", "boats",
                 "electric scooters"],
    "materials": ["wood", "steel", "plastic", "glass", "aluminum", "cotton", "wool", "paper"],
    "places": ["cities", "villages", "mountains", "beaches", "forests", "deserts", "islands"],
    "energy": ["solar power", "wind power", "coal", "natural gas", "nuclear power",
               "hydroelectric power"],
    "hobbies": ["painting", "knitting", "gardening", "photography", "chess", "reading",
                "cooking", "hiking", "playing the guitar"],
    "work": ["working from home", "working in an office", "freelancing", "full-time jobs",
             "part-time jobs", "starting a business"],
    "learning": ["books", "videos", "podcasts", "online courses", "classroom lessons",
                 "study groups"],
}
COMPARE_TEMPLATES = [
    "Compare {a} and {b}.",
    "What is the difference between {a} and {b}?",
    "What do {a} and {b} have in common?",
    "Write a short paragraph comparing {a} with {b}.",
]

ACTIVITIES = [
    "bake banana bread", "change a flat bicycle tire", "plant tomatoes", "make a budget",
    "brew coffee with a French press", "tie a tie", "write a cover letter", "clean a laptop screen",
    "start running as a beginner", "learn to juggle", "make a paper airplane", "set up a fish tank",
    "prepare for an exam", "fold a fitted sheet", "make homemade pizza dough", "wash a wool sweater",
    "organize a bookshelf", "train a puppy to sit", "make a simple website", "install Python",
    "create a strong password", "back up files on a computer", "grow herbs on a windowsill",
    "make a cup of green tea", "remove a coffee stain", "write a thank-you note",
    "prepare for a job interview", "meditate for ten minutes", "cook rice on the stove",
    "make scrambled eggs", "paint a room", "pack a suitcase efficiently", "plan a picnic",
    "start a vegetable garden", "learn basic chess openings", "make a smoothie", "study for a math test",
    "write a short speech", "build a birdhouse", "take care of a cactus", "sharpen a kitchen knife",
    "make a to-do list that works", "keep a plant alive while on vacation",
    "make a simple salad dressing", "clean a cast iron pan", "stretch after a workout",
    "set up a home office", "organize a small garage sale", "write a haiku",
    "teach a child to ride a bike", "make a weekly meal plan", "unclog a kitchen sink",
    "start a journal", "give a good presentation", "save money for a trip",
    "reduce food waste at home", "make cold brew coffee", "hang a picture frame",
    "learn new vocabulary words", "prepare a simple first aid kit", "make friends in a new city",
    "improve handwriting", "bake a simple sponge cake", "prepare for a hiking trip",
    "set goals for the new year", "learn to swim as an adult", "make a family tree",
    "compost kitchen scraps", "wrap a present neatly", "write a good email subject line",
    "host a board game night", "clean white sneakers", "make a paper crane",
    "memorize a short poem", "start learning the guitar", "check the oil in a car",
    "make homemade soup", "create a morning routine", "write a book review",
]
STEP_TEMPLATES = [
    "How do I {a}?",
    "Give me step-by-step instructions to {a}.",
    "What is the easiest way to {a}?",
    "What mistakes should beginners avoid when they try to {a}?",
    "Write a short checklist to help me {a}.",
    "Explain to a friend how to {a}.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a string",
    "returns the factorial of a number", "computes the nth Fibonacci number",
    "removes duplicates from a list", "finds the second largest number in a list",
    "checks whether a word is a palindrome", "converts Celsius to Fahrenheit",
    "merges two sorted lists", "flattens a nested list", "counts how often each word appears in a text",
    "returns the sum of the digits of a number", "checks whether two strings are anagrams",
    "sorts a list of tuples by the second element", "reads a text file and counts its lines",
    "finds the longest word in a sentence", "generates a random password",
    "converts a decimal number to binary", "capitalizes the first letter of every word",
    "calculates the average of a list of numbers", "finds common elements in two lists",
    "checks whether a year is a leap year", "prints a multiplication table",
    "returns the greatest common divisor of two numbers", "splits a list into chunks of size n",
    "counts the number of uppercase letters in a string", "rotates a list by k positions",
    "checks whether a list is sorted", "finds the index of an item using binary search",
    "removes all punctuation from a string", "returns the n largest items from a list",
    "converts a list of strings to integers", "computes the median of a list",
    "implements a simple stack class", "implements a simple queue class",
    "validates a simple email address format", "counts the words in a sentence",
    "returns the running total of a list", "groups words by their first letter",
    "finds the missing number in a list from 1 to n", "implements bubble sort",
    "implements insertion sort", "transposes a matrix given as a list of lists",
    "converts a dictionary to a list of key-value pairs", "merges two dictionaries",
    "returns the unique characters in a string", "checks whether a string contains only digits",
    "computes the power of a number without using the ** operator",
    "finds all even numbers in a list", "simulates rolling a six-sided die",
    "formats a number with commas as thousands separators", "reverses the words in a sentence",
    "counts the occurrences of a character in a string", "returns the minimum and maximum of a list",
    "converts minutes to hours and minutes", "checks whether brackets in a string are balanced",
    "calculates compound interest", "finds the most common element in a list",
    "creates a dictionary from two lists", "replaces spaces in a string with underscores",
    "calculates the area of a circle", "prints a simple triangle of stars",
    "finds prime numbers up to n", "converts a string to title case without using title()",
    "counts the lines in a CSV file", "returns the length of the longest run of equal items",
    "shuffles a list without using random.shuffle", "checks whether a number is a perfect square",
    "converts Roman numerals to integers", "sums all numbers in a nested list",
]
CODE_TEMPLATES = [
    "Write a Python function that {t}.",
    "Show me Python code that {t}.",
    "How would you write a Python program that {t}?",
    "Write a Python function that {t}, and explain how it works.",
    "Write a Python function that {t}, with a docstring and a short usage example.",
    "Write a short Python script that {t}, and add comments to each step.",
]

WORDS = [
    "ambiguous", "benevolent", "candid", "diligent", "eloquent", "frugal", "gregarious",
    "hypothesis", "inevitable", "juxtapose", "meticulous", "nostalgia", "obsolete", "pragmatic",
    "resilient", "serendipity", "tenacious", "ubiquitous", "versatile", "whimsical", "algorithm",
    "biodiversity", "catalyst", "democracy", "ecosystem", "friction", "gravity", "habitat",
    "inflation", "justice", "kinetic energy", "latitude", "metaphor", "nutrition", "orbit",
    "photosynthesis", "quarantine", "recession", "symbiosis", "tariff", "urbanization",
    "velocity", "wavelength", "archipelago", "bibliography", "citizenship", "dividend",
    "empathy", "fossil fuel", "glacier", "hemisphere", "irony", "jargon", "kindness",
    "legislation", "migration", "narrative", "optimism", "paradox", "quota", "renaissance",
    "sustainability", "telescope", "utopia", "vocabulary", "wilderness", "abundance",
    "curiosity", "deadline", "etiquette", "feedback", "gratitude", "hobby", "innovation",
    "loyalty", "mentor", "negotiation", "opinion", "patience", "recipe", "souvenir",
    "tradition", "volunteer", "workshop", "budget", "compiler", "database", "encryption",
    "function", "variable", "bandwidth", "cloud computing", "debugging", "interest rate",
    "mortgage", "entrepreneur", "brand", "metabolism", "antibiotic", "calorie", "allergy",
    "vaccine", "tide", "erosion", "continent", "peninsula", "monsoon", "drought", "evaporation",
    "condensation", "constellation", "eclipse", "molecule", "electron", "magnet", "fermentation",
    "marinade", "simmer", "knead", "umami", "marathon", "referee", "stamina", "tournament",
    "itinerary", "jet lag", "passport", "hostel", "alliteration", "onomatopoeia", "haiku",
    "synonym", "antonym", "prefix", "suffix", "procrastination", "minimalism", "compromise",
    "perseverance", "integrity", "courage", "humility", "generosity", "skepticism", "nuance",
]
DEFINE_TEMPLATES = [
    "Define the word '{w}'.",
    "What does '{w}' mean? Use it in a sentence.",
    "Give a simple definition of '{w}' for a child.",
    "What is the meaning of '{w}'? Give two example sentences.",
]

SITUATIONS = [
    "is starting college next month", "wants to learn to cook", "just moved to a new city",
    "is nervous about public speaking", "wants to run their first marathon",
    "has trouble falling asleep", "wants to save money for a house", "is starting a new job",
    "wants to learn to play the piano", "feels stressed about exams",
    "wants to eat more vegetables", "is looking for their first apartment",
    "wants to get better at time management", "is learning to code for the first time",
    "wants to make new friends as an adult", "is planning their first trip abroad",
    "wants to start a small garden", "spends too much time on their phone",
    "wants to read more books", "is preparing for a job interview", "is adopting a dog",
    "wants to become a better writer", "works from home and feels lonely",
    "wants to get fit without a gym", "is starting a small online shop",
    "wants to learn a second language", "is going to be a manager for the first time",
    "has a disagreement with a roommate", "wants to drink less coffee",
    "is retiring next year", "wants to volunteer in their community",
    "is afraid of flying", "wants to keep their home tidy", "is learning to drive",
    "wants to wake up earlier", "is writing their first novel", "feels unmotivated at work",
    "wants to teach their kids about money", "is hosting a dinner party for the first time",
    "wants to take better photos with a phone", "is switching careers at forty",
    "wants to eat healthier on a budget", "is starting to learn chess",
    "is moving in with a partner", "wants to ask for a raise", "is caring for an elderly parent",
    "wants to reduce their plastic use", "is taking a gap year", "wants to run a book club",
    "is training for a long bike ride",
]
ADVICE_TEMPLATES = [
    "What advice would you give to someone who {s}?",
    "Give me five tips for someone who {s}.",
    "Write a short encouraging message for a friend who {s}.",
]

CHARACTERS = [
    "a young girl", "an old fisherman", "a curious cat", "a brave knight", "a small robot",
    "a shy dragon", "a lonely astronaut", "a clever fox", "a retired teacher", "a talking tree",
    "a young baker", "a lost puppy", "a forgetful wizard", "a busy mail carrier", "a tiny mouse",
    "a famous chef", "a nervous student", "a friendly ghost", "a grumpy old man", "a pirate captain",
    "a detective", "a group of friends", "a farmer", "a street musician", "a little penguin",
    "a kind librarian", "an inventor", "a soccer player", "a princess", "a zookeeper",
    "a time traveler", "a lighthouse cat", "a firefighter", "an owl", "a painter",
    "a young scientist", "a grandmother", "a talking bicycle", "a snowman", "a bus driver",
]
PLOTS = [
    "finds a mysterious key", "gets lost in a big city", "discovers a hidden garden",
    "learns to fly", "makes an unexpected friend", "enters a baking contest",
    "finds a map to a treasure", "wakes up with a strange new power", "travels to the Moon",
    "has to save a village from a storm", "loses something important", "opens a small shop",
    "goes on a long journey by train", "finds a door in the forest", "wins a prize by accident",
    "must solve a puzzle to get home", "meets a creature from the sea", "learns a secret about the family",
    "helps a stranger in trouble", "builds a machine that goes wrong", "spends a night in a museum",
    "tries to break a world record", "gets stuck in an elevator", "receives a letter from the future",
    "plants a seed that grows overnight", "forgets how to speak", "joins a traveling circus",
    "finds a talking book", "climbs the tallest mountain", "has one day to find a birthday present",
    "races against a rival", "learns that kindness matters", "discovers an island that is not on any map",
    "adopts an unusual pet", "wants to become a musician", "has to cross a frozen river",
    "gets a message in a bottle", "teaches a robot to laugh", "solves a mystery in a small town",
    "shrinks to the size of an ant",
]
STORY_TEMPLATES = [
    "Write a short story about {c} who {p}.",
    "Tell me a bedtime story about {c} who {p}.",
    "Write a funny story about {c} who {p}.",
    "Write the opening paragraph of a story about {c} who {p}.",
    "Write a story in exactly five sentences about {c} who {p}.",
]

RECIPIENTS = [
    "your manager", "a coworker", "your landlord", "a teacher", "a friend", "your neighbor",
    "a former classmate", "a client", "your team", "a new colleague", "your cousin", "a mentor",
    "your professor", "a customer",
]
PURPOSES = [
    "thanking them for their help", "apologizing for a late reply",
    "inviting them to a small celebration", "asking to reschedule a meeting",
    "sharing some good news", "asking for advice about a decision", "introducing yourself",
    "following up on a previous conversation", "congratulating them on a recent success",
    "asking for a recommendation", "saying goodbye before moving away",
    "confirming plans for next week",
]
MESSAGE_TEMPLATES = [
    "Write a short email to {r} {p}.",
    "Write a polite letter to {r} {p}.",
    "Write a friendly text message to {r} {p}.",
    "Write a formal email to {r} {p}.",
]

PRODUCTS = [
    "a reusable water bottle", "wireless headphones", "a solar-powered lamp", "a standing desk",
    "a bamboo toothbrush", "a smart thermostat", "a hiking backpack", "a coffee grinder",
    "a yoga mat", "an electric kettle", "a children's picture book", "a mechanical keyboard",
    "a houseplant subscription box", "a folding bicycle", "a handmade candle", "a rain jacket",
    "a board game about space", "a cast iron skillet", "a fitness tracker", "a travel pillow",
    "noise-cancelling earbuds", "a portable phone charger", "an herb garden kit",
    "a wooden chess set", "a set of watercolor paints", "a pair of running shoes",
    "a lunch box with compartments", "a language learning app", "a desk lamp", "a picnic blanket",
]
PRODUCT_TEMPLATES = [
    "Write a product description for {p}.",
    "Write a short advertisement for {p}.",
    "Write a customer review of {p}.",
]

DISHES = [
    "banana bread", "tomato soup", "a vegetable stir-fry", "chicken curry", "guacamole",
    "pancakes", "a Greek salad", "lentil soup", "spaghetti with garlic and olive oil",
    "fried rice", "oatmeal cookies", "a fruit salad", "mashed potatoes", "a veggie omelette",
    "hummus", "chili", "a tuna sandwich", "roasted vegetables", "apple crumble", "pesto pasta",
    "French toast", "a berry smoothie", "vegetable fried noodles", "baked salmon", "potato salad",
    "shakshuka", "a bean burrito", "corn bread", "mushroom risotto", "lemon muffins",
]
RECIPE_TEMPLATES = [
    "Give me a simple recipe for {d}.",
    "What ingredients do I need to make {d}?",
    "How can I make {d} healthier?",
]

CITIES = [
    "Paris", "Tokyo", "Rome", "Barcelona", "London", "New York", "Istanbul", "Cairo",
    "Sydney", "Kyoto", "Lisbon", "Prague", "Vienna", "Amsterdam", "Berlin", "Mexico City",
    "Buenos Aires", "Cape Town", "Bangkok", "Seoul", "Toronto", "Vancouver", "Dublin",
    "Edinburgh", "Athens", "Marrakech", "Singapore", "Hanoi", "Copenhagen", "Budapest",
]
CITY_TEMPLATES = [
    "What are the best things to do in {c}?",
    "What food should I try when visiting {c}?",
    "Write a short travel guide for a first visit to {c}.",
]

COUNTRIES = [
    "France", "Japan", "Brazil", "Canada", "Egypt", "Kenya", "India", "Australia", "Mexico",
    "Italy", "Spain", "Germany", "Norway", "Peru", "Argentina", "Thailand", "Vietnam",
    "South Korea", "Morocco", "Greece", "Turkey", "Portugal", "Chile", "Ireland", "Sweden",
    "New Zealand", "Nigeria", "Indonesia", "Poland", "Switzerland", "Iceland", "Colombia",
    "the Netherlands", "Finland", "Ghana", "Cuba", "Denmark", "Austria", "China", "Russia",
]
COUNTRY_TEMPLATES = [
    "What is the capital of {c}?",
    "On which continent is {c}?",
    "What languages are spoken in {c}?",
    "What is {c} famous for?",
    "Tell me about the traditional food of {c}.",
]
INVENTIONS = [
    "the light bulb", "the telephone", "the printing press", "the airplane", "the steam engine",
    "the radio", "the television", "the computer", "the bicycle", "the camera", "the compass",
    "paper", "the wheel", "the microscope", "the telescope", "the refrigerator",
    "the World Wide Web", "the sewing machine", "the thermometer", "the vaccine for smallpox",
]
INVENTION_TEMPLATES = ["Who invented {i}?", "How did {i} change people's lives?"]
ELEMENTS = [
    "gold", "silver", "iron", "copper", "oxygen", "hydrogen", "carbon", "nitrogen", "helium",
    "sodium", "potassium", "calcium", "zinc", "lead", "mercury", "aluminum", "neon", "sulfur",
    "tin", "uranium", "chlorine", "magnesium", "platinum", "silicon",
]
ELEMENT_TEMPLATES = ["What is the chemical symbol for {e}?", "What are common uses of {e}?"]
TRIVIA_ANIMALS = [
    "giraffes", "kangaroos", "polar bears", "koalas", "camels", "octopuses", "hummingbirds",
    "chameleons", "bats", "sea turtles", "pandas", "cheetahs", "flamingos", "beavers",
    "hedgehogs", "crocodiles", "jellyfish", "parrots", "squirrels", "rabbits",
]
ANIMAL_TEMPLATES = ["What do {a} eat?", "Where do {a} live in the wild?",
                    "What is unusual about {a}?"]

NAMES = [
    "Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Isabel", "Jamal",
    "Kira", "Leo", "Maya", "Noah", "Olivia", "Pablo", "Quinn", "Rosa", "Sam", "Tara",
    "Umar", "Vera", "Wei", "Ximena", "Yusuf", "Zoe", "Amara", "Bruno", "Chloe", "Diego",
    "Elena", "Felix", "Gita", "Hugo", "Ines", "Jonas", "Keiko", "Liam", "Mina", "Nadia",
    "Oscar", "Priya", "Raj", "Sofia", "Tomas", "Uma", "Victor", "Wanda", "Yara", "Zain",
]
COUNTABLES = [
    "apples", "marbles", "stickers", "pencils", "cookies", "books", "stamps", "seashells",
    "cards", "balloons", "oranges", "crayons", "toy cars", "cupcakes", "flowers", "buttons",
]
PREDICATES = [
    "walked to the market to buy fresh bread", "finished reading a long novel about pirates",
    "fixed the old bicycle in the garage", "planted three rows of carrots in the garden",
    "called the bank to ask about a new account", "baked a chocolate cake for a friend",
    "missed the bus and had to walk to work", "painted the kitchen a bright yellow color",
    "wrote a letter to a pen pal in Canada", "cleaned the whole apartment before the guests arrived",
    "learned how to play a new song on the guitar", "forgot the umbrella at the coffee shop",
    "took the dog for a long walk in the park", "cooked pasta with fresh tomatoes and basil",
    "signed up for a beginner swimming class", "found an old photo album in the attic",
    "helped a neighbor carry groceries up the stairs", "visited the science museum with cousins",
    "started a small vegetable garden on the balcony", "ran five kilometers without stopping",
    "built a wooden shelf for the living room", "organized all the files on the computer",
    "watched the sunrise from the top of the hill", "sent a thank-you card to a teacher",
    "repaired a leaking tap in the bathroom", "bought a new pair of hiking boots",
    "spent the afternoon studying for a history exam", "made a list of goals for the new year",
    "tried sushi for the first time", "lost the keys and searched the house for an hour",
    "drove to the coast to see the ocean", "volunteered at the local animal shelter",
    "finished a difficult puzzle with a thousand pieces", "wrote a short poem about the rain",
    "rearranged the furniture in the bedroom", "picked strawberries at a farm outside town",
    "gave a short presentation to the whole team", "returned three overdue books to the library",
    "learned to make coffee with a new machine", "adopted a small gray kitten",
]
TIMES = [
    "on Saturday morning", "last week", "after dinner", "yesterday afternoon", "before sunrise",
    "during the summer holidays", "on a rainy Tuesday", "late last night", "over the weekend",
    "early this morning", "two days ago", "on the first day of spring", "after work",
    "during the lunch break", "last month",
]
REWRITE_TEMPLATES = [
    "Repeat this sentence exactly: {s}",
    "Rewrite this sentence in a more formal tone: {s}",
    "Rewrite this sentence in simpler words: {s}",
    "Paraphrase the following sentence: {s}",
    "Rewrite this sentence in the present tense: {s}",
    "Rewrite this sentence from the first-person point of view: {s}",
    "Turn this sentence into a question: {s}",
    "Translate this sentence into French: {s}",
    "Make this sentence more exciting: {s}",
]
SUMMARY_TEMPLATES = [
    "Summarize the following text in one sentence: {p}",
    "Repeat the following text, then give it a title: {p}",
]


# --------------------------------------------------------------------------------------------
# Arithmetic word problems (random numbers, always integer answers)
# --------------------------------------------------------------------------------------------

def _math_makers():
    def m_buy(r):
        n, x = r.choice(NAMES), r.choice(COUNTABLES)
        a, b = r.randint(3, 60), r.randint(2, 40)
        return f"{n} has {a} {x} and gets {b} more. How many {x} does {n} have now?"

    def m_give(r):
        n, m, x = *r.sample(NAMES, 2), r.choice(COUNTABLES)
        a = r.randint(10, 90)
        b = r.randint(1, a - 1)
        return f"{n} had {a} {x} and gave {b} of them to {m}. How many {x} does {n} have left?"

    def m_boxes(r):
        x = r.choice(COUNTABLES)
        a, b = r.randint(4, 25), r.randint(2, 15)
        return f"A box holds {a} {x}. How many {x} are there in {b} boxes?"

    def m_pages(r):
        n = r.choice(NAMES)
        a, b = r.randint(5, 40), r.randint(3, 30)
        return f"{n} reads {a} pages every day. How many pages will {n} read in {b} days?"

    def m_cost(r):
        x = r.choice(COUNTABLES)
        a, b = r.randint(2, 15), r.randint(2, 12)
        return f"A shop sells {x} for {a} dollars each. How much do {b} {x} cost?"

    def m_share(r):
        n, x = r.choice(NAMES), r.choice(COUNTABLES)
        b, q = r.randint(2, 9), r.randint(2, 12)
        return (f"{n} shares {b * q} {x} equally among {b} friends. "
                f"How many {x} does each friend get?")

    def m_speed(r):
        a, b = r.randrange(30, 130, 5), r.randint(2, 8)
        return f"A car travels at {a} kilometers per hour. How far does it travel in {b} hours?"

    def m_wage(r):
        n = r.choice(NAMES)
        a, b = r.randint(8, 40), r.randint(3, 40)
        return f"{n} earns {a} dollars per hour and works {b} hours. How much money does {n} earn?"

    def m_area(r):
        a, b = r.randint(2, 30), r.randint(2, 30)
        what = r.choice(["area", "perimeter"])
        return f"A rectangle is {a} meters long and {b} meters wide. What is its {what}?"

    def m_class(r):
        a = r.randint(15, 40)
        b = r.randint(1, 9)
        return (f"There are {a} students in a class and {b} of them are absent today. "
                "How many students are present?")

    def m_save(r):
        n = r.choice(NAMES)
        a, b = r.randint(5, 50), r.randint(3, 20)
        return f"{n} saves {a} dollars each week. How many weeks will it take to save {a * b} dollars?"

    def m_recipe(r):
        a, b = r.randint(2, 5), r.randint(2, 9)
        return f"A recipe needs {a} cups of flour for one cake. How many cups are needed for {b} cakes?"

    def m_sale(r):
        p = r.choice([10, 20, 25, 50])
        price = r.randrange(20, 401, 20)
        item = r.choice(["jacket", "lamp", "backpack", "pair of shoes", "chair", "watch", "bicycle"])
        return f"A {item} costs {price} dollars and is on sale for {p} percent off. What is the sale price?"

    def m_age(r):
        n, m = r.sample(NAMES, 2)
        a, b = r.randint(5, 40), r.randint(2, 15)
        return f"{n} is {a} years old. {m} is {b} years older than {n}. How old is {m}?"

    def m_train(r):
        h, d = r.randint(5, 14), r.randint(1, 8)
        return f"A train leaves at {h}:00 and the trip takes {d} hours. At what time does it arrive?"

    def m_two_step(r):
        n, x = r.choice(NAMES), r.choice(COUNTABLES)
        a, b, c = r.randint(3, 9), r.randint(3, 12), r.randint(1, 10)
        return (f"{n} buys {a} bags with {b} {x} in each bag, then loses {c} {x}. "
                f"How many {x} does {n} have?")

    def m_rows(r):
        a, b = r.randint(3, 20), r.randint(3, 20)
        return f"A garden has {a} rows of trees with {b} trees in each row. How many trees are there?"

    return [m_buy, m_give, m_boxes, m_pages, m_cost, m_share, m_speed, m_wage, m_area, m_class,
            m_save, m_recipe, m_sale, m_age, m_train, m_two_step, m_rows]


# --------------------------------------------------------------------------------------------
# Pool construction
# --------------------------------------------------------------------------------------------

def _sample(rng: random.Random, items: list, k: int) -> list:
    return items if len(items) <= k else rng.sample(items, k)


def _unique_draws(rng: random.Random, make, k: int, tries: int = 20) -> list[str]:
    out: dict[str, None] = {}
    for _ in range(k * tries):
        out[make(rng)] = None
        if len(out) >= k:
            break
    return list(out)


def _groups() -> list[list[str]]:
    """One list of prompts per template; the pool is fixed (seeded by _POOL_SEED)."""
    rng = random.Random(_POOL_SEED)
    groups: list[list[str]] = []

    all_topics = [t for ts in TOPICS.values() for t in ts]
    for tpl in GENERIC_TOPIC_TEMPLATES:
        groups.append([tpl.format(t=t) for t in all_topics])
    for dom, tpls in DOMAIN_TEMPLATES.items():
        for tpl in tpls:
            groups.append([tpl.format(t=t) for t in TOPICS[dom]])

    for tpl in LIST_TEMPLATES:
        groups.append([tpl.format(n=n, c=c) for c in LIST_CATEGORIES for n in range(3, 11)])

    pairs = [(a, b) for items in COMPARE_ITEMS.values() for a, b in itertools.combinations(items, 2)]
    for tpl in COMPARE_TEMPLATES:
        groups.append([tpl.format(a=a, b=b) if rng.random() < 0.5 else tpl.format(a=b, b=a)
                       for a, b in pairs])

    for tpl in STEP_TEMPLATES:
        groups.append([tpl.format(a=a) for a in ACTIVITIES])
    for tpl in CODE_TEMPLATES:
        groups.append([tpl.format(t=t) for t in CODE_TASKS])
    for make in _math_makers():
        groups.append(_unique_draws(rng, make, 400))
    for tpl in DEFINE_TEMPLATES:
        groups.append([tpl.format(w=w) for w in WORDS])
    for tpl in ADVICE_TEMPLATES:
        groups.append([tpl.format(s=s) for s in SITUATIONS])

    stories = list(itertools.product(CHARACTERS, PLOTS))
    for tpl in STORY_TEMPLATES:
        groups.append([tpl.format(c=c, p=p) for c, p in _sample(rng, stories, 500)])
    dialogue_pairs = [(a, b) for a, b in itertools.permutations(CHARACTERS, 2)]
    groups.append([f"Write a short dialogue between {a} and {b} about {t}."
                   for (a, b), t in zip(_sample(rng, dialogue_pairs, 600),
                                        (rng.choice(all_topics) for _ in range(600)))])

    for tpl in MESSAGE_TEMPLATES:
        groups.append([tpl.format(r=r, p=p) for r in RECIPIENTS for p in PURPOSES])
    for tpl in PRODUCT_TEMPLATES:
        groups.append([tpl.format(p=p) for p in PRODUCTS])
    for tpl in RECIPE_TEMPLATES:
        groups.append([tpl.format(d=d) for d in DISHES])
    for tpl in CITY_TEMPLATES:
        groups.append([tpl.format(c=c) for c in CITIES])
    groups.append([f"Plan a {d}-day trip to {c}." for c in CITIES for d in range(2, 8)])
    for tpl in COUNTRY_TEMPLATES:
        groups.append([tpl.format(c=c) for c in COUNTRIES])
    for tpl in INVENTION_TEMPLATES:
        groups.append([tpl.format(i=i) for i in INVENTIONS])
    for tpl in ELEMENT_TEMPLATES:
        groups.append([tpl.format(e=e) for e in ELEMENTS])
    for tpl in ANIMAL_TEMPLATES:
        groups.append([tpl.format(a=a) for a in TRIVIA_ANIMALS])

    sentences = [f"{n} {p} {t}." for n in NAMES for p in PREDICATES for t in TIMES]
    for tpl in REWRITE_TEMPLATES:
        groups.append([tpl.format(s=s) for s in _sample(rng, sentences, 500)])

    def paragraph(r: random.Random) -> str:
        n = r.choice(NAMES)
        preds, times = r.sample(PREDICATES, 3), r.sample(TIMES, 3)
        first = f"{n} {preds[0]} {times[0]}."
        rest = " ".join(f"Then {n} {p} {t}." for p, t in zip(preds[1:], times[1:]))
        return f"{first} {rest}"

    for tpl in SUMMARY_TEMPLATES:
        groups.append([tpl.format(p=paragraph(rng)) for _ in range(400)])
    return groups


def _norm(s: str) -> str:
    return " ".join(s.split()).casefold()


def _held_out() -> set[str]:
    held: set[str] = set()
    for name in _HELD_OUT_FILES:
        with open(_HELD_OUT_DIR / name, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    held.add(_norm(json.loads(line)["prompt"]))
    return held


@functools.lru_cache(maxsize=1)
def _pool() -> tuple[tuple[str, ...], ...]:
    held, seen = _held_out(), set()
    out = []
    for group in _groups():
        kept = []
        for p in group:
            if p not in seen and _norm(p) not in held:
                seen.add(p)
                kept.append(p)
        if kept:
            out.append(tuple(kept))
    return tuple(out)


def available_prompts() -> int:
    """How many distinct training prompts `training_prompts` can return."""
    return sum(len(g) for g in _pool())


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """Return `n` distinct training prompts, deterministically ordered by `seed`.

    Each template's prompts are shuffled with `random.Random(seed)` and the templates are then
    interleaved (round-robin with random tie-breaking), so any prefix covers all templates.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    total = available_prompts()
    if n > total:
        raise ValueError(f"requested {n} training prompts but only {total} distinct prompts are available")
    rng = random.Random(seed)
    keyed = []
    for group in _pool():
        items = list(group)
        rng.shuffle(items)
        keyed.extend((i + rng.random(), p) for i, p in enumerate(items))
    keyed.sort(key=lambda kp: kp[0])
    return [p for _, p in keyed[:n]]
